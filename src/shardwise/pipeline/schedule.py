"""Pure pipeline schedules: GPipe, 1F1B, forward-only (inference / eval), and the expansion every
schedule shares.

A schedule is first written as each stage's compute order (forwards and backwards of (micro-batch,
chunk)); `expand` then adds, around each compute step, the loads, receives and sends it needs, and the
gradient reduction and optimizer step at the end. The compute order alone decides the timeline; the
expansion is the same for every schedule, so a schedule cannot get its communication wrong by itself.

Imports nothing from torch: tested without processes, simulated by `simulate.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .instructions import COMPUTE, Instruction, Op, Schedule, check_sizes

Step = tuple[Op, int, int]
"""(compute op, micro-batch, chunk): one entry of a stage's compute order."""


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards (GPipe). Every stage holds all `micro_batches` activations at
    the turn; the bubble matches 1F1B's. The baseline the others improve on."""
    check_sizes(stages, micro_batches)
    forwards = [(Op.FORWARD, mb, 0) for mb in range(micro_batches)]
    backwards = [(Op.BACKWARD, mb, 0) for mb in range(micro_batches)]
    return expand("gpipe", stages, micro_batches, 1, [forwards + backwards] * stages)


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """1F1B (PipeDream-flush, DeepSpeed's TrainSchedule): stage `s` runs min(stages - s - 1, m) warm-up
    forwards, then alternates one forward and one backward, then drains the remaining backwards. The
    bubble is GPipe's, but stage `s` never holds more than min(stages - s, m) micro-batches' activations."""
    check_sizes(stages, micro_batches)
    return expand("1f1b", stages, micro_batches, 1,
                  [_one_f_one_b_order(s, stages, micro_batches) for s in range(stages)])


def _one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[Step]:
    warmup = min(stages - stage - 1, micro_batches)
    order: list[Step] = [(Op.FORWARD, mb, 0) for mb in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [(Op.FORWARD, warmup + i, 0), (Op.BACKWARD, i, 0)]
    order += [(Op.BACKWARD, mb, 0) for mb in range(micro_batches - warmup, micro_batches)]
    return order


def inference(stages: int, micro_batches: int, *, labels: bool = True) -> Schedule:
    """Forward only (eval_batch when `labels`, so the last stage computes the loss; plain inference
    otherwise): no backward, no gradient reduction, no optimizer step."""
    check_sizes(stages, micro_batches)
    order = [(Op.FORWARD, mb, 0) for mb in range(micro_batches)]
    return expand("inference", stages, micro_batches, 1, [order] * stages, training=False, labels=labels)


def expand(name: str, stages: int, micro_batches: int, chunks: int, orders: Sequence[Iterable[Step]], *,
           training: bool = True, labels: bool = True) -> Schedule:
    """Each stage's compute order, with its loads, receives and sends around each step and (when
    `training`) REDUCE_GRADS and OPTIMIZER_STEP after the last one."""
    per_stage = []
    for stage, order in enumerate(orders):
        instructions: list[Instruction] = []
        for op, mb, chunk in order:
            if op not in COMPUTE:
                raise ValueError(f"compute order of stage {stage}: only forward/backward ops are steps; got {op}. "
                                 "Sends, receives and loads are added by expand().")
            place = _Place(stage, stages, chunk, chunks)
            instructions += _forward(place, mb, labels) if op is Op.FORWARD else _backward(place, op, mb)
        if training:
            instructions += [Instruction(Op.REDUCE_GRADS), Instruction(Op.OPTIMIZER_STEP)]
        per_stage.append(tuple(instructions))
    return Schedule(name, stages, micro_batches, chunks, tuple(per_stage))


class _Place:
    """Where a chunk sits in the chain of virtual stages: is it the first or last, who are its neighbours."""

    def __init__(self, stage: int, stages: int, chunk: int, chunks: int):
        self.chunk = chunk
        self.virtual = chunk * stages + stage
        self.first = self.virtual == 0
        self.last = self.virtual == stages * chunks - 1
        self.prev_stage = (stage - 1) % stages  # the last stage's chunk c feeds stage 0's chunk c + 1
        self.next_stage = (stage + 1) % stages


def _forward(place: _Place, mb: int, labels: bool) -> list[Instruction]:
    out = [Instruction(Op.LOAD_MICRO_BATCH, mb, place.chunk) if place.first
           else Instruction(Op.RECV_ACTIVATION, mb, place.chunk, place.prev_stage)]
    if place.last and labels:
        out.append(Instruction(Op.LOAD_LABELS, mb, place.chunk))
    out.append(Instruction(Op.FORWARD, mb, place.chunk))
    if not place.last:
        out.append(Instruction(Op.SEND_ACTIVATION, mb, place.chunk, place.next_stage))
    return out


def _backward(place: _Place, op: Op, mb: int) -> list[Instruction]:
    """A full backward or its input half (B) waits for the output's gradient and passes the input's
    gradient on; the weight half (W) needs no communication."""
    if op is Op.BACKWARD_WEIGHT:
        return [Instruction(op, mb, place.chunk)]
    out = [] if place.last else [Instruction(Op.RECV_GRAD, mb, place.chunk, place.next_stage)]
    out.append(Instruction(op, mb, place.chunk))
    if not place.first:
        out.append(Instruction(Op.SEND_GRAD, mb, place.chunk, place.prev_stage))
    return out
