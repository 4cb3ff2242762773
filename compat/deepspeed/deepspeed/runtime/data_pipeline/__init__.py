"""`deepspeed.runtime.data_pipeline`: curriculum learning's scheduler and data analyzer, mapped onto
`shardwise.data_efficiency`."""

from . import curriculum_scheduler, data_sampling

__all__ = ["curriculum_scheduler", "data_sampling"]
