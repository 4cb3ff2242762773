"""The memory planner: per-rank peak memory of a training config, by parts, before the run.

`shape.py` describes a model by its parameter counts (`ModelShape`) and the activations of one traced
micro-batch (`ActivationProfile`); `plan.py` turns those, a config and a world size into a `MemoryPlan`;
`measure.py` measures the real peak the plan is checked against, and `probe.py` checks the plan against step 2
of a run; `cli.py` is `shardwise plan`, which builds the model `models.py` names and plans one rank as
`ranks.py` splits it (the way `initialize` does); `changes.py` names config changes as dotted-key overrides,
`oom.py` explains an out-of-memory error with the changes whose plans fit, and `estimates.py` answers DeepSpeed's
model-state estimators.
"""

from .measure import AllocationMeter
from .plan import MemoryPlan, Part, plan
from .shape import ActivationProfile, ModelShape

__all__ = ["ActivationProfile", "AllocationMeter", "MemoryPlan", "ModelShape", "Part", "plan"]
