"""Checkpointed activations in host memory (ALST's activation-checkpoint offload), for Hugging Face models'
own gradient checkpointing: what a checkpointed layer keeps for its recompute (its inputs, the hidden states:
with checkpointing, the bulk of what a long-sequence step holds between forward and backward) lives in host
memory, pinned on CUDA, and comes back to the device in backward. Nothing else moves: the layers' activations
are not kept at all (the recompute makes them again), and those outside the checkpointed layers stay where
they are.

shardwise's own `checkpoint` does this when the config says `activation_checkpointing.cpu_checkpointing`
(runtime/activation_checkpointing.py), and `use_hf_layers` puts that checkpointer into a Hugging Face model;
but that replaces the model's checkpoint function (its `use_reentrant` and other kwargs with it), and the
Trainer's `gradient_checkpointing_enable()` at the start of `train()` replaces it back. `offload_checkpoints`
instead wraps whatever checkpoint function the model's layers hold at each forward, so it holds whether
checkpointing was enabled before or after it, and with either flavour of `torch.utils.checkpoint`: both save
the checkpointed call's inputs under the saved-tensor hooks active at the call, and only those (the reentrant
one runs the call under no_grad; the non-reentrant one replaces the hooks inside it with its own).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["CheckpointOffload", "HostStash", "offload_checkpoints", "offloaded_checkpoint"]


class HostStash(torch.autograd.graph.saved_tensors_hooks):
    """Under it, tensors saved for backward are kept in host memory (pinned when they come from CUDA, so the
    copies both ways are asynchronous) and copied back to their device when backward unpacks them. Tensors
    already on the CPU are kept as they are: there is nothing to move.

    Counts what it kept, across every use: `tensors`, and `host_bytes` copied off a device."""

    def __init__(self) -> None:
        self.tensors = 0
        self.host_bytes = 0
        super().__init__(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
        self.tensors += 1
        if tensor.device.type == "cpu":
            return None, tensor
        pinned = tensor.device.type == "cuda" and not tensor.is_sparse
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
        host.copy_(tensor, non_blocking=pinned)
        self.host_bytes += host.numel() * host.element_size()
        return tensor.device, host


def _unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
    device, tensor = packed
    return tensor if device is None else tensor.to(device, non_blocking=tensor.is_pinned())


def offloaded_checkpoint(function: Callable[..., Any], *args: Any, stash: HostStash | None = None,
                         **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint(function, *args, **kwargs)` with the inputs it keeps for the
    recompute in host memory (`stash`, default a fresh one). Usable wherever a checkpoint function is taken (a
    Hugging Face model's `_set_gradient_checkpointing(gradient_checkpointing_func=...)`)."""
    with stash if stash is not None else HostStash():
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)


class _Offloaded:
    """A layer's checkpoint function, its kept inputs going to `stash`."""

    def __init__(self, function: Callable[..., Any], stash: HostStash) -> None:
        self.function, self.stash = function, stash

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.stash:
            return self.function(*args, **kwargs)


class CheckpointOffload:
    """What `offload_checkpoints` installed on a model; `remove()` (or leaving its `with` block) takes it off.
    `stash` counts what went to host memory."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stash = HostStash()
        self._layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        if not self._layers:
            raise TypeError(f"offload_checkpoints: {type(model).__name__} has no module with Hugging Face's "
                            "`gradient_checkpointing` flag, so there is no checkpoint function to offload; use "
                            "offloaded_checkpoint(function, *args) in its forward, or shardwise's checkpoint with "
                            "activation_checkpointing.cpu_checkpointing.")
        self._handles = [model.register_forward_pre_hook(self._check)]
        self._handles += [m.register_forward_pre_hook(self._wrap) for m in self._layers]

    def _check(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and not any(m.gradient_checkpointing for m in self._layers):
            raise RuntimeError(
                f"offload_checkpoints: gradient checkpointing is off in {type(self.model).__name__}, so nothing "
                "would be kept in host memory; call model.gradient_checkpointing_enable() before training, or "
                "remove the offload (handle.remove()).")

    def _wrap(self, module: nn.Module, args: Any) -> None:
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is not None and not (isinstance(function, _Offloaded) and function.stash is self.stash):
            module._gradient_checkpointing_func = _Offloaded(function, self.stash)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._layers:
            function = getattr(module, "_gradient_checkpointing_func", None)
            if isinstance(function, _Offloaded) and function.stash is self.stash:
                module._gradient_checkpointing_func = function.function

    def __enter__(self) -> CheckpointOffload:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def offload_checkpoints(model: nn.Module) -> CheckpointOffload:
    """Keep what `model`'s gradient checkpointing keeps for the recompute in host memory (pinned on CUDA), from
    its next forward until the returned handle's `remove()`; also a context manager. `model` is a Hugging Face
    model (layers with a `gradient_checkpointing` flag), checkpointing enabled before or after this call; a
    training forward with checkpointing off is refused, as it would offload nothing."""
    return CheckpointOffload(model)
