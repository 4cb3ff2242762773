"""Host <-> device copies of offloaded state on a CUDA stream of their own, so that they run beside the compute
stream's kernels instead of queueing behind them. Without pinned host buffers (or on the CPU) every copy is a
plain one on the current stream: only page-locked memory copies asynchronously.

[Note: copy-stream ordering]
- Host to device (a ZeRO-3 parameter slice fetched from host memory ahead of its all-gather): the copy does not
  wait for the compute stream, since its source is host memory that no kernel writes and its destination is
  allocated on the copy stream. The compute stream then waits for the copy, so the all-gather and all that
  follows see the whole slice; the copy itself overlaps whatever compute was queued before. `record_stream`
  tells the allocator that the compute stream uses the new tensor, so that its memory is not handed to a later
  copy before that use is done.
- Device to host (gradient slices for the host optimizer): the copy stream first waits for the compute stream
  (the gradients are its results), and each gradient is recorded on the copy stream, so that memory the compute
  stream frees meanwhile is not reused under the copy. The host must wait for the returned event before it
  reads the copies.
- A host buffer a pending host-to-device copy reads is written again only after the host has waited on a later
  device-to-host event (the next step's gradients), which orders it after the copy.
"""

from __future__ import annotations

import torch


class CopyStream:
    """One side stream per device for offload traffic; without pinned buffers or CUDA, plain copies."""

    def __init__(self, pinned: bool):
        self.pinned = pinned and torch.cuda.is_available()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A fresh device copy of `host`, ready for whatever the current stream queues next."""
        if not (self.pinned and device.type == "cuda" and host.is_pinned()):
            return host.to(device, copy=True)
        compute, side = torch.cuda.current_stream(device), self._stream(device)
        with torch.cuda.stream(side):
            copy = host.to(device, non_blocking=True, copy=True)
        copy.record_stream(compute)
        compute.wait_stream(side)
        return copy

    def to_host(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> tuple[list[torch.Tensor], object]:
        """Host copies of `tensors` in `dtype`, and an event to synchronize on before reading them (None when
        the copies are already complete)."""
        if not (self.pinned and tensors and tensors[0].is_cuda):
            return [t.to("cpu", dtype) for t in tensors], None
        device = tensors[0].device
        side = self._stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host = [t.to("cpu", dtype, non_blocking=True) for t in tensors]
            for t in tensors:
                t.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return host, event
