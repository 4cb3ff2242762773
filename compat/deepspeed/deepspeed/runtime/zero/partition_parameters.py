"""`deepspeed.runtime.zero.partition_parameters`: what scripts and Hugging Face import from it.

transformers' `prevent_arange_dtype_change` swaps `zero_wrapper_for_fp_tensor_constructor` around
`zero.Init`; shardwise's `Init` does not wrap tensor constructors (it never changes a tensor's dtype),
so the hook is the identity and swapping it changes nothing.
"""

import torch
from shardwise.accelerator import get_accelerator
from shardwise.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, *args, **kwargs):  # noqa: ANN001,ANN002,ANN003,ANN201
    return fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]
