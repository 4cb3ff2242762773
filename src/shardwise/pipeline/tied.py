"""Tied weights across pipeline stages (see [Note: tied weights across stages] in `module.py`).

The owner (the lowest stage using a key) trains the weight. Each other user accumulates its gradient in
fp32 over the batch's micro-batches and sends it to the owner after its last backward; the owner adds what
it receives to the weight's gradient inside its own last backward (a one-shot gradient hook), so the sum
is reduced across data-parallel ranks with the rest and the norm counts it once. After the step, the owner
sends the updated weight back. Every user of a key computes with the same weight at every step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .module import PipelineModule
from .p2p import StageLink


class TiedWeights:
    def __init__(self, module: PipelineModule, link: StageLink, device: torch.device, param_dtype: torch.dtype,
                 accum_dtype: torch.dtype):
        self.module, self.link, self.accum_dtype = module, link, accum_dtype
        self.stage = module.stage_id
        self.shared = {key: stages for key, stages in module.tied_stages.items() if len(stages) > 1}
        if self.shared and module.num_chunks > 1:
            raise ValueError(f"tied layers {sorted(self.shared)} span stages {self.shared}, which the interleaved "
                             "schedule (num_chunks > 1) does not support yet; use num_chunks=1.")
        self._ids = {(key, i): n for n, (key, i) in enumerate(
            (key, i) for key in sorted(self.shared) for i in range(len(module.tied_attrs[key])))}
        self._accumulators: list[torch.Tensor] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._added: list[bool] = []
        for key in self._unowned():
            for i, copy in enumerate(module.tied_tensors(key)):
                # not parameters: `.to()` and the precision policy pass them by
                dtype = param_dtype if copy.is_floating_point() else copy.dtype
                moved = copy.detach().to(device=device, dtype=dtype).requires_grad_(copy.requires_grad)
                module.set_tied_tensor(key, i, moved)
                self._accumulate(moved)

    def _owned(self) -> list[str]:
        return [k for k in sorted(self.shared) if self.shared[k][0] == self.stage]

    def _unowned(self) -> list[str]:
        return [k for k in sorted(self.shared) if self.stage in self.shared[k][1:]]

    def _accumulate(self, tensor: torch.Tensor) -> None:
        """Sum the copy's gradients over the micro-batches in `accum_dtype` (fp32 under bf16/fp16 weights)."""
        acc = torch.zeros(tensor.shape, dtype=self.accum_dtype, device=tensor.device)
        self._accumulators.append(acc)

        def take(t: torch.Tensor) -> None:
            acc.add_(t.grad)
            t.grad = None

        tensor.register_post_accumulate_grad_hook(take)

    def sync_weights(self) -> None:
        """The owner's weights to every other user (at start, after each step and after a load)."""
        for key in self._owned():
            for i, weight in enumerate(self.module.tied_tensors(key)):
                for user in self.shared[key][1:]:
                    self.link.send_tensor(weight, user, self._ids[(key, i)])
        for key in self._unowned():
            owner = self.shared[key][0]
            for i, copy in enumerate(self.module.tied_tensors(key)):
                received = torch.empty_like(copy, memory_format=torch.contiguous_format)
                self.link.recv_tensor(received, owner, self._ids[(key, i)])
                with torch.no_grad():
                    copy.copy_(received)
        self.link.wait_sends()

    def send_grads(self) -> None:
        """Another user, after its last backward: its batch's gradient to the owner."""
        tensors = [(key, i) for key in self._unowned() for i in range(len(self.module.tied_attrs[key]))]
        for (key, i), acc in zip(tensors, self._accumulators):
            self.link.send_tensor(acc.clone(), self.shared[key][0], self._ids[(key, i)])
            acc.zero_()

    def expect_grads(self) -> None:
        """The owner, before its last backward: receive the other users' gradients and have that backward add
        them to the weight's own."""
        self._added.clear()
        for key in self._owned():
            for i, weight in enumerate(self.module.tied_tensors(key)):
                total = torch.zeros(weight.shape, dtype=self.accum_dtype, device=weight.device)
                for user in self.shared[key][1:]:
                    received = torch.empty_like(total)
                    self.link.recv_tensor(received, user, self._ids[(key, i)])
                    total.add_(received)
                self._hooks.append(weight.register_hook(self._adder(total, len(self._added))))
                self._added.append(False)

    def _adder(self, total: torch.Tensor, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def add(grad: torch.Tensor) -> torch.Tensor:
            if self._added[index]:
                return grad
            self._added[index] = True
            return grad + total.to(grad.dtype)

        return add

    def check_added(self) -> None:
        """After the owner's last backward: every received gradient went in (else the weight got no gradient in
        that backward, and the other stages' part would be lost)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if not all(self._added):
            raise RuntimeError(f"tied layers {self._owned()}: the owning stage {self.stage} computed no gradient for "
                               "a tied weight in its last backward, so the other stages' gradients for it could not "
                               "be added; every micro-batch must use the tied layer with gradients enabled.")
