"""`deepspeed.runtime.zero` / `deepspeed.zero`: ZeRO-3's construction and parameter-access API."""

from shardwise.zero import GatheredParameters, Init, register_external_parameter

from . import partition_parameters
from .partition_parameters import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters", "register_external_parameter"]
