"""`deepspeed.runtime`: its submodules are attributes after `import deepspeed`, as scripts (and accelerate's
`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`) expect."""

from . import (activation_checkpointing, config, data_pipeline, dataloader, domino, engine, lr_schedules, pipe,
               tensor_parallel, utils, zero)

__all__ = ["activation_checkpointing", "config", "data_pipeline", "dataloader", "domino", "engine", "lr_schedules",
           "pipe", "tensor_parallel", "utils", "zero"]
