"""Contracts between packages: protocols and the dataclasses passed across them.

A leaf: these modules import no implementation (only config sections and the types of groups, collectives
and the precision policy), so every package may depend on them and none of them depends back. The
factories live with what they build (`zero/factory.py` builds a `ShardingStrategy`).
"""

from .engine import BackgroundSaver, TrainingEngine
from .strategy import MakeOptimizer, ModelStateTensors, NoRankLocalState, ParamGroups, ShardingStrategy, StateSlot, StrategyInputs
from .tensor_shard import TensorShard

__all__ = ["BackgroundSaver", "MakeOptimizer", "ModelStateTensors", "NoRankLocalState", "ParamGroups", "ShardingStrategy", "StateSlot",
           "StrategyInputs", "TensorShard", "TrainingEngine"]
