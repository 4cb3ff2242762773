"""Runs one stage's instructions of a `Schedule`, in order: the only place a schedule meets tensors.

What the stage computes and where its data and gradients go is the engine's business (`StageHooks`); the
executor keeps the micro-batches in flight (inputs until their backward, outputs until their gradient
arrives) and moves them through `StageLink`. Nothing is decided here at run time: a schedule that the
simulator accepts runs as simulated.

Weight gradients arrive in the backward ops; the engine opens its gradient window around each, and learns
which one is this stage's last (`last=True`), where the data-parallel reduction overlaps the backward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .instructions import Instruction, Op
from .p2p import StageLink

WEIGHT_GRADS = (Op.BACKWARD, Op.BACKWARD_WEIGHT)


class StageHooks(Protocol):
    def inputs(self, micro_batch: int) -> Any:
        """The first stage's input of `micro_batch` (on the device)."""

    def labels(self, micro_batch: int) -> Any:
        """The last stage's labels of `micro_batch` (on the device)."""

    def forward(self, inputs: Any, chunk: int) -> Any: ...

    def loss(self, outputs: Any, labels: Any) -> torch.Tensor: ...

    def loss_factor(self) -> float:
        """What the loss is multiplied by before its backward (the loss scale over the micro-batches)."""

    def begin_weight_grads(self, last: bool) -> None: ...

    def end_weight_grads(self, last: bool) -> None: ...

    def reduce_grads(self, losses: list[torch.Tensor]) -> None:
        """After the stage's last backward, with the batch's losses (the last stage's; empty elsewhere)."""

    def optimizer_step(self) -> None: ...


@dataclass
class BatchResult:
    timeline: list[tuple[Instruction, float, float]] = field(default_factory=list)
    """(instruction, start, end) in time.perf_counter() seconds, when the executor records them."""
    peak_in_flight: int = 0
    """The most micro-batches whose activations this stage held at once (1F1B: at most stages - stage)."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """The last stage's loss of each micro-batch (detached), in order; empty elsewhere."""
    last_output: Any = None
    """The last stage's output of the last micro-batch (eval_batch's logits)."""


class StageExecutor:
    def __init__(self, hooks: StageHooks, link: StageLink, stage: int, stages: int, chunks: int):
        self.hooks, self.link = hooks, link
        self.stage, self.stages, self.chunks = stage, stages, chunks
        self.record_timeline = False
        """Time every instruction into `BatchResult.timeline` (benchmarks/pipeline_parallel.py measures the bubble)."""

    def run(self, instructions: Sequence[Instruction], train: bool, compute_loss: bool = True) -> BatchResult:
        batch = _Batch(train, compute_loss)
        weight_ops = [i for i, ins in enumerate(instructions) if ins.op in WEIGHT_GRADS]
        last_weight_op = weight_ops[-1] if weight_ops else -1
        try:
            for index, ins in enumerate(instructions):
                start = time.perf_counter() if self.record_timeline else 0.0
                self._execute(ins, batch, last=index == last_weight_op)
                if self.record_timeline:
                    batch.result.timeline.append((ins, start, time.perf_counter()))
        finally:
            self.link.wait_sends()
        return batch.result

    def _virtual(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def _is_last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.stages * self.chunks - 1

    def _execute(self, ins: Instruction, batch: _Batch, last: bool) -> None:
        key = (ins.micro_batch, ins.chunk)
        op = ins.op
        if op is Op.LOAD_MICRO_BATCH:
            batch.inputs[key] = self.hooks.inputs(ins.micro_batch)
        elif op is Op.LOAD_LABELS:
            batch.labels[ins.micro_batch] = self.hooks.labels(ins.micro_batch)
        elif op is Op.RECV_ACTIVATION:
            batch.inputs[key] = self.link.recv_activation(ins.peer, ins.micro_batch, ins.chunk)
        elif op is Op.FORWARD:
            self._forward(key, batch)
        elif op is Op.SEND_ACTIVATION:
            out = batch.outputs[key] if batch.train else batch.outputs.pop(key)
            self.link.send_activation(out, ins.peer, ins.micro_batch, ins.chunk)
        elif op is Op.RECV_GRAD:
            like = _needing_grad(batch.outputs[key])
            batch.output_grads[key] = self.link.recv_grads(like, ins.peer, ins.micro_batch, ins.chunk)
        elif op is Op.BACKWARD:
            self._backward(key, batch, last)
        elif op is Op.SEND_GRAD:
            self.link.send_grads(batch.input_grads.pop(key), ins.peer, ins.micro_batch, ins.chunk)
        elif op is Op.REDUCE_GRADS:
            self.hooks.reduce_grads(batch.result.losses)
        elif op is Op.OPTIMIZER_STEP:
            self.hooks.optimizer_step()
        else:
            raise NotImplementedError(f"{ins}: the executor runs forward/backward schedules; split backward "
                                      "(zero-bubble) schedules are simulated only (shardwise.pipeline.zb_h1).")

    def _forward(self, key: tuple[int, int], batch: _Batch) -> None:
        micro_batch, chunk = key
        inputs = batch.inputs[key] if batch.train else batch.inputs.pop(key)
        with torch.set_grad_enabled(batch.train):
            out = self.hooks.forward(inputs, chunk)
            batch.result.peak_in_flight = max(batch.result.peak_in_flight, len(batch.inputs))
            if not self._is_last(chunk):
                batch.outputs[key] = out
                return
            batch.result.last_output = out
            if not batch.compute_loss:
                batch.result.losses.append(out.detach() if isinstance(out, torch.Tensor) else out)
                return
            loss = self.hooks.loss(out, batch.labels.pop(micro_batch, None))
        batch.result.losses.append(loss.detach())
        if batch.train:
            batch.outputs[key] = loss

    def _backward(self, key: tuple[int, int], batch: _Batch, last: bool) -> None:
        out = batch.outputs.pop(key)
        self.hooks.begin_weight_grads(last)
        if self._is_last(key[1]):
            (out * self.hooks.loss_factor()).backward()
        else:
            torch.autograd.backward(_needing_grad(out), batch.output_grads.pop(key))
        self.hooks.end_weight_grads(last)
        inputs = batch.inputs.pop(key)
        if self._virtual(key[1]) > 0:
            batch.input_grads[key] = [t.grad if t.grad is not None else torch.zeros_like(t)
                                      for t in _needing_grad(inputs)]


class _Batch:
    """The micro-batches in flight on this stage during one batch, by (micro-batch, chunk)."""

    def __init__(self, train: bool, compute_loss: bool):
        self.train, self.compute_loss = train, compute_loss
        self.inputs: dict[tuple[int, int], Any] = {}
        self.labels: dict[int, Any] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.output_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.input_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.result = BatchResult()


def _needing_grad(value: Any) -> list[torch.Tensor]:
    items = value if isinstance(value, tuple) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
