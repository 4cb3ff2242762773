"""`deepspeed.runtime.zero.offload_config`: the offload enums scripts import (DeepSpeedExamples' offload_states
passes them to `engine.offload_states`). Their values are the config's strings, as in DeepSpeed."""

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
