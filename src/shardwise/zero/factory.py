"""The one place a ZeRO stage is chosen: config stage → the strategy that implements it."""

from __future__ import annotations

from ..protocols import ShardingStrategy, StrategyInputs


def make_strategy(inputs: StrategyInputs) -> ShardingStrategy:
    stage = inputs.zero.stage
    if stage == 0 and inputs.compressed_optimizer:
        from .compressed_dp import CompressedDataParallel

        return CompressedDataParallel(inputs)
    if stage == 0:
        from .stage0 import DataParallel

        return DataParallel(inputs)
    if stage in (1, 2):
        from .stage1_2 import ShardedDataParallel

        return ShardedDataParallel(inputs, stage)
    from .stage3.strategy import Stage3

    return Stage3(inputs)
