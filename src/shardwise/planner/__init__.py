"""The memory planner: per-rank peak memory of a training config, by parts, before the run.

`shape.py` describes a model by its parameter counts (`ModelShape`) and the activations of one traced
micro-batch (`ActivationProfile`); `plan.py` turns those, a config and a world size into a `MemoryPlan`;
`measure.py` measures the real peak the plan is checked against; `cli.py` is `shardwise plan`, which plans one
rank as `ranks.py` splits it (the way `initialize` does); `changes.py`
names config changes as dotted-key overrides, and `oom.py` explains an out-of-memory error with the changes
whose plans fit.
"""

from .measure import AllocationMeter
from .plan import MemoryPlan, Part, plan
from .shape import ActivationProfile, ModelShape

__all__ = ["ActivationProfile", "AllocationMeter", "MemoryPlan", "ModelShape", "Part", "plan"]
