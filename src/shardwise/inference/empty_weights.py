"""Build a model whose parameters take no memory: they are created on the meta device and filled later, shard by
shard, from a checkpoint (`init_inference(model, checkpoint=...)`).

Only parameters go to meta. Buffers stay real because many are not in any checkpoint: rotary embeddings'
`inv_freq`, causal masks and position ids are computed at construction, and a meta buffer could not be rebuilt.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Within the block, every `nn.Module` parameter is created on the meta device (no storage, no init cost)."""
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def meta_names(module: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Names of the parameters and of the buffers still on the meta device."""
    params = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    buffers = [n for n, b in module.named_buffers() if b.device.type == "meta"]
    return params, buffers
