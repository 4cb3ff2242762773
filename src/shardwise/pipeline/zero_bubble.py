"""ZB-H1, the zero-bubble schedule of Qi et al. (2023) that keeps 1F1B's peak memory: backward split
into B (the input's gradient, what the previous stage waits for) and W (the weight gradients, which
nobody waits for), W deferred to fill the bubble.

Stage `s` runs 1F1B's warm-up and steady order with B in place of the full backward, and lets up to `s`
W's wait: they run in the drain, where 1F1B's stages sit idle for gradients. Because B alone is on the
gradient's critical path, gradients travel back faster, and the later stages (which idle longest at the
end of 1F1B) defer the most. Each stage then holds at most min(stages, m) micro-batches' activations (a
micro-batch is released by its W): every stage as much as 1F1B's first stage, never more. With
B = W, the bubble is (stages - 1) × (F + B - W), a third of 1F1B's when F = B = W.
"""

from __future__ import annotations

from collections import deque

from .instructions import Op, Schedule, check_sizes
from .schedule import Step, expand


def zb_h1(stages: int, micro_batches: int) -> Schedule:
    """ZB-H1 for `stages` stages and `micro_batches` micro-batches (any counts)."""
    check_sizes(stages, micro_batches)
    return expand("zb_h1", stages, micro_batches, 1,
                  [_order(s, stages, micro_batches) for s in range(stages)])


def _order(stage: int, stages: int, micro_batches: int) -> list[Step]:
    warmup = min(stages - stage - 1, micro_batches)
    deferred = stage  # W's allowed to wait; the memory bound min(stages, m) follows from warmup + 1 + stage
    order: list[Step] = [(Op.FORWARD, mb, 0) for mb in range(warmup)]
    waiting: deque[int] = deque()

    def backward_input(mb: int) -> None:
        order.append((Op.BACKWARD_INPUT, mb, 0))
        waiting.append(mb)
        if len(waiting) > deferred:
            order.append((Op.BACKWARD_WEIGHT, waiting.popleft(), 0))

    for i in range(micro_batches - warmup):
        order.append((Op.FORWARD, warmup + i, 0))
        backward_input(i)
    for mb in range(micro_batches - warmup, micro_batches):
        backward_input(mb)
    order += [(Op.BACKWARD_WEIGHT, mb, 0) for mb in waiting]
    return order
