"""`deepspeed.compression.helper`: the module-path helpers scripts import from it (DeepSpeed-Chat's LoRA code),
as Python's getattr/setattr along a dotted path. Compression training itself is not in shardwise (the
`compression_training` config section is refused)."""

import functools


def recursive_getattr(model, module_name):  # noqa: ANN001,ANN201
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model, module_name, module):  # noqa: ANN001,ANN201
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)


__all__ = ["recursive_getattr", "recursive_setattr"]
