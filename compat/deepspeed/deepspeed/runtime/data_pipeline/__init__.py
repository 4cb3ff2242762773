"""`deepspeed.runtime.data_pipeline`: curriculum learning's scheduler and data analyzer, and the data-routing
(random-LTD) names scripts import, mapped onto `shardwise.data_efficiency`."""

from . import curriculum_scheduler, data_routing, data_sampling

__all__ = ["curriculum_scheduler", "data_routing", "data_sampling"]
