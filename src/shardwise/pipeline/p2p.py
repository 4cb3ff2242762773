"""Activations and their gradients between pipeline stages, through the collectives choke point.

What crosses is a tensor or a tuple of tensors. Its description (how many, each one's dtype, shape and
whether it needs a gradient) is sent once per (direction, chunk), ahead of the first payload, and kept by
both ends; after that only payloads cross. A later activation whose description differs is refused by its
sender, naming both (a smaller last batch, a changed sequence length), never sent into buffers of the old
shape; `reset()` (engine.reset_activation_shape()) negotiates again. Gradients flow back only for the
floating-point tensors that needed one, in the shapes the activation had, so they need no description.

Tags keep the streams apart on gloo: activation / gradient / tied tensors, per micro-batch and chunk. Both
ends of an edge tag it with the chunk of its producing side: with interleaving, stage 0's chunk c consumes the
last stage's chunk c - 1, so the consumer's own chunk number would never match the producer's tag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import Collectives, Group
from ..distributed.collectives import Pending

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
HEADER = 64
"""int64 slots of a description: [is_tuple, count, then per tensor: dtype, requires_grad, ndim, *shape]."""
ACTIVATION, GRADIENT, TIED = 0, 1, 2


@dataclass(frozen=True)
class Meta:
    """What one stage's output looks like: enough for the next stage to allocate and receive it."""

    is_tuple: bool
    tensors: tuple[tuple[torch.dtype, bool, tuple[int, ...]], ...]

    @classmethod
    def of(cls, value: torch.Tensor | tuple[torch.Tensor, ...]) -> Meta:
        items = value if isinstance(value, tuple) else (value,)
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a pipeline stage's output must be a tensor or a tuple of tensors; item {i} is a "
                                f"{type(t).__name__}. Return tensors only (pass other values as tensors).")
            if t.dtype not in _DTYPES:
                raise TypeError(f"a pipeline stage's output item {i} has dtype {t.dtype}, which stages cannot "
                                f"exchange; use one of {[str(d).removeprefix('torch.') for d in _DTYPES]}.")
        return cls(isinstance(value, tuple), tuple((t.dtype, t.requires_grad, tuple(t.shape)) for t in items))

    def encode(self) -> torch.Tensor:
        values = [int(self.is_tuple), len(self.tensors)]
        for dtype, grad, shape in self.tensors:
            values += [_DTYPES.index(dtype), int(grad), len(shape), *shape]
        if len(values) > HEADER:
            raise ValueError(f"a pipeline stage's output of {len(self.tensors)} tensors needs {len(values)} header "
                             f"slots, more than {HEADER}; return fewer tensors (concatenate them).")
        return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor) -> Meta:
        values = header.tolist()
        is_tuple, count, at, tensors = bool(values[0]), values[1], 2, []
        for _ in range(count):
            dtype, grad, ndim = values[at : at + 3]
            tensors.append((_DTYPES[dtype], bool(grad), tuple(values[at + 3 : at + 3 + ndim])))
            at += 3 + ndim
        return cls(is_tuple, tuple(tensors))

    def describe(self) -> str:
        return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for d, _, s in self.tensors)


class StageLink:
    """This stage's point-to-point traffic with the other stages (global ranks from `peers[stage]`)."""

    def __init__(self, comm: Collectives, group: Group, peers: list[int], device: torch.device):
        self.comm, self.group, self.peers, self.device = comm, group, peers, device
        self._sent: dict[int, Meta] = {}
        self._received: dict[int, Meta] = {}
        self.pending: list[tuple[Pending, torch.Tensor]] = []
        """Posted sends with their buffers, which must live until `wait_sends`."""

    def reset(self) -> None:
        self._sent.clear()
        self._received.clear()

    def send_activation(self, value: torch.Tensor | tuple[torch.Tensor, ...], stage: int, micro_batch: int,
                        chunk: int) -> None:
        meta = Meta.of(value)
        agreed = self._sent.get(chunk)
        if agreed is None:
            self._post(meta.encode().to(self.device), stage, ACTIVATION, -1, chunk)
            self._sent[chunk] = meta
        elif agreed != meta:
            raise ValueError(f"pipeline stage {self.group.rank}, chunk {chunk}, micro-batch {micro_batch}: the output "
                             f"is [{meta.describe()}] but the stages agreed on [{agreed.describe()}] at the first "
                             "micro-batch; every micro-batch must have the same shapes (drop or pad a smaller last "
                             "batch: dataloader_drop_last), or call engine.reset_activation_shape() between batches "
                             "whose shapes differ.")
        for t in _items(value):
            self._post(t.detach().contiguous(), stage, ACTIVATION, micro_batch, chunk)

    def recv_activation(self, stage: int, micro_batch: int, chunk: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        meta = self._received.get(chunk)
        if meta is None:
            header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
            self._recv(header, stage, ACTIVATION, -1, self._producer_chunk(chunk))
            meta = self._received[chunk] = Meta.decode(header.cpu())
        tensors = []
        for dtype, grad, shape in meta.tensors:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._recv(t, stage, ACTIVATION, micro_batch, self._producer_chunk(chunk))
            tensors.append(t.requires_grad_(grad and dtype.is_floating_point))
        return tuple(tensors) if meta.is_tuple else tensors[0]

    def send_grads(self, grads: list[torch.Tensor], stage: int, micro_batch: int, chunk: int) -> None:
        for g in grads:
            self._post(g.contiguous(), stage, GRADIENT, micro_batch, self._producer_chunk(chunk))

    def recv_grads(self, like: list[torch.Tensor], stage: int, micro_batch: int, chunk: int) -> list[torch.Tensor]:
        grads = []
        for t in like:
            g = torch.empty_like(t, memory_format=torch.contiguous_format)
            self._recv(g, stage, GRADIENT, micro_batch, chunk)
            grads.append(g)
        return grads

    def send_tensor(self, tensor: torch.Tensor, stage: int, index: int) -> None:
        """Tied weights and their gradients (`index` tells them apart)."""
        self._post(tensor.detach().contiguous(), stage, TIED, index, 0)

    def recv_tensor(self, out: torch.Tensor, stage: int, index: int) -> None:
        self._recv(out, stage, TIED, index, 0)

    def wait_sends(self) -> None:
        for pending, _ in self.pending:
            pending.wait()
        self.pending.clear()

    def _producer_chunk(self, chunk: int) -> int:
        """The chunk that feeds this stage's `chunk`: on stage 0 the last stage's previous chunk."""
        return chunk - 1 if self.group.rank == 0 else chunk

    def _post(self, tensor: torch.Tensor, stage: int, kind: int, micro_batch: int, chunk: int) -> None:
        tag = _tag(kind, micro_batch, chunk)
        self.pending.append((self.comm.send(tensor, self.peers[stage], self.group, tag), tensor))

    def _recv(self, tensor: torch.Tensor, stage: int, kind: int, micro_batch: int, chunk: int) -> None:
        self.comm.recv(tensor, self.peers[stage], self.group, _tag(kind, micro_batch, chunk)).wait()


def _items(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _tag(kind: int, micro_batch: int, chunk: int) -> int:
    return ((micro_batch + 1) * 64 + chunk) * 4 + kind
