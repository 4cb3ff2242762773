"""`deepspeed.runtime.data_pipeline`: the data-routing (random-LTD) names scripts import, mapped onto
`shardwise.data_efficiency`."""

from . import data_routing

__all__ = ["data_routing"]
