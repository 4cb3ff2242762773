"""Offload policies: where master weights, optimizer state and (stage 3) parameters live."""

from .optimizer import HostOffload, NvmeOffload, OnDevice, make_optimizer_offload
from .params import ParamsOnDevice, ParamsOnHost, ParamsOnNvme, make_param_home

__all__ = ["HostOffload", "NvmeOffload", "OnDevice", "ParamsOnDevice", "ParamsOnHost", "ParamsOnNvme",
           "make_optimizer_offload", "make_param_home"]
