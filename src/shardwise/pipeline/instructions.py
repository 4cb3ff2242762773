"""The instructions a pipeline schedule hands to each stage, and the `Schedule` that holds them.

A schedule is data: per stage (pipeline rank), an ordered tuple of `Instruction`s. The executor runs its
own stage's tuple from first to last; nothing is decided at run time. What the executor must do with each:

- LOAD_MICRO_BATCH(mb): first stage only. Take micro-batch `mb`'s inputs from the data iterator; they are
  the input of chunk 0's forward.
- LOAD_LABELS(mb): last stage only. Take micro-batch `mb`'s labels; the last chunk's forward computes the
  loss from them. (Both ends read the same data iterator position, so the loaders must agree on order.)
- RECV_ACTIVATION(mb, chunk, peer): receive from stage `peer` the input of this stage's `chunk` for `mb`;
  wait for it before the FORWARD that follows.
- FORWARD(mb, chunk): run `chunk`'s layers on `mb`; keep what backward needs (the in-flight activations).
- SEND_ACTIVATION(mb, chunk, peer): post (non-blocking, an isend) `chunk`'s output for `mb` to stage `peer`.
- RECV_GRAD(mb, chunk, peer): receive from stage `peer` the gradient of `chunk`'s output for `mb`.
- BACKWARD(mb, chunk): full backward of `chunk` for `mb` (input and weight gradients); frees `mb`'s
  activations of that chunk. Weight gradients accumulate across micro-batches.
- BACKWARD_INPUT(mb, chunk): zero-bubble split, part B: only the gradient with respect to the chunk's
  input (what the previous stage waits for). Keep what the weight gradient still needs.
- BACKWARD_WEIGHT(mb, chunk): zero-bubble split, part W: the weight gradients of `mb`; frees the rest of
  its activations. Always after that micro-batch's BACKWARD_INPUT on the same chunk.
- SEND_GRAD(mb, chunk, peer): post (non-blocking) the gradient of `chunk`'s input for `mb` to `peer`.
- REDUCE_GRADS: after the stage's last backward: reduce gradients of tied weights across the stages
  that share them, then across data-parallel replicas.
- OPTIMIZER_STEP: step the optimizer, zero the gradients; the stage's last instruction.

Sends never block in this model: the executor posts them and waits for all of them to finish before the
next batch reuses their buffers (a blocking send would deadlock orders that are valid here). Receives
block. `simulate.py` runs a schedule under exactly this rule, so a schedule it accepts cannot deadlock
an executor that follows it.

Chunks: a stage holds `chunks` model chunks (virtual stages, interleaved schedules). Chunk `c` of stage
`s` is virtual stage `c * stages + s`; activations flow from virtual stage `v` to `v + 1`. An
instruction's `chunk` is always the local chunk the tensor belongs to: a send names the chunk that
produced it, a receive the chunk that will consume it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(enum.Enum):
    """What an instruction asks the executor to do (see the module docstring)."""

    LOAD_MICRO_BATCH = "load_micro_batch"
    LOAD_LABELS = "load_labels"
    RECV_ACTIVATION = "recv_activation"
    FORWARD = "forward"
    SEND_ACTIVATION = "send_activation"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    SEND_GRAD = "send_grad"
    REDUCE_GRADS = "reduce_grads"
    OPTIMIZER_STEP = "optimizer_step"


COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
SENDS = frozenset({Op.SEND_ACTIVATION, Op.SEND_GRAD})
RECEIVES = frozenset({Op.RECV_ACTIVATION, Op.RECV_GRAD})


@dataclass(frozen=True)
class Instruction:
    """One step of one stage. `micro_batch` is None only for REDUCE_GRADS and OPTIMIZER_STEP; `peer` is
    set exactly on sends and receives."""

    op: Op
    micro_batch: int | None = None
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        parts = [] if self.micro_batch is None else [f"mb={self.micro_batch}", f"chunk={self.chunk}"]
        if self.peer is not None:
            parts.append(("to" if self.op in SENDS else "from") + f"={self.peer}")
        return f"{self.op.value}({', '.join(parts)})"


@dataclass(frozen=True)
class Schedule:
    """A whole pipeline's plan for one batch: `per_stage[s]` is stage `s`'s ordered instructions."""

    name: str
    stages: int
    micro_batches: int
    chunks: int
    per_stage: tuple[tuple[Instruction, ...], ...]

    def __post_init__(self) -> None:
        if len(self.per_stage) != self.stages:
            raise ValueError(f"per_stage: one instruction list per stage ({self.stages}) is required; "
                             f"got {len(self.per_stage)}. Build it with one list per pipeline rank.")

    @property
    def virtual_stages(self) -> int:
        """Stages × chunks: the length of the chain activations flow through."""
        return self.stages * self.chunks


def check_sizes(stages: int, micro_batches: int) -> None:
    """The arguments every generator takes, refused loudly when they cannot describe a pipeline."""
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: a positive int is required; got {value!r}. "
                             f"Pass the number of pipeline {name.replace('_', '-')}.")
