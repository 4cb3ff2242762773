"""Interleaved 1F1B (Megatron-LM's virtual pipeline): each stage holds `chunks` model chunks, so a
micro-batch passes every stage `chunks` times and the fill/drain bubble shrinks by that factor.

Stage `s`'s chunk `c` is virtual stage `c * stages + s`. Each stage walks micro-batches in groups of
`stages`: forwards of the group on chunk 0, then on chunk 1, ..., then the next group; backwards walk
the chunks in reverse. Warm-up is Megatron's 2 × (stages - s - 1) + (chunks - 1) × stages forwards.
Without the first term's factor 2 the schedule still runs and has the same bubble when transfers are
free, and holds fewer activations; but each transfer's latency then stalls the steady state, where
the longer warm-up keeps the next forward's input already there (the simulator shows both).
"""

from __future__ import annotations

from .instructions import Op, Schedule, check_sizes
from .schedule import Step, expand


def interleaved_1f1b(stages: int, micro_batches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B over `chunks` model chunks per stage. `micro_batches` must be a multiple of
    `stages`: the schedule moves micro-batches through the chunks in groups of exactly `stages`."""
    check_sizes(stages, micro_batches)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 2:
        raise ValueError(f"chunks: at least 2 model chunks per stage are required to interleave; got {chunks!r}. "
                         "Use one_f_one_b() for one chunk per stage.")
    if micro_batches % stages:
        lower, upper = micro_batches - micro_batches % stages, micro_batches + stages - micro_batches % stages
        fix = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(f"micro_batches: a multiple of stages ({stages}) is required by the interleaved schedule; "
                         f"got {micro_batches}. Use {fix} micro-batches (gradient_accumulation_steps), "
                         "or one_f_one_b().")
    orders = [_order(s, stages, micro_batches, chunks) for s in range(stages)]
    return expand("interleaved_1f1b", stages, micro_batches, chunks, orders)


def _unit(k: int, stages: int, chunks: int, forward: bool) -> Step:
    """The k-th forward (or backward) unit of any stage: which micro-batch, on which chunk."""
    group, within = divmod(k, stages * chunks)
    position = within // stages
    chunk = position if forward else chunks - 1 - position
    return (Op.FORWARD if forward else Op.BACKWARD, group * stages + k % stages, chunk)


def _order(stage: int, stages: int, micro_batches: int, chunks: int) -> list[Step]:
    total = micro_batches * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    order = [_unit(k, stages, chunks, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [_unit(warmup + k, stages, chunks, True), _unit(k, stages, chunks, False)]
    order += [_unit(k, stages, chunks, False) for k in range(total - warmup, total)]
    return order
