"""`torch_autocast`: the engine's forward under torch.autocast, as DeepSpeed runs it.

Enabled: the module runs under `torch.autocast(device, dtype)` (parameters and master weights stay as
fp16/bf16.enabled say; autocast picks each op's dtype). Disabled while the caller has autocast on around
the engine: DeepSpeed switches it off inside the engine (its fp16/bf16 settings govern precision there),
and so does shardwise, with the same one-time warning.

`lower_precision_safe_modules` names module classes; DeepSpeed reduces their gradients in the autocast
dtype. Here every gradient is reduced in `communication_data_type` (fp32 unless set): the names are only
checked to import, so a typo fails as it does in DeepSpeed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Callable, ContextManager

import torch

from ..config import ConfigError
from ..config.notes import note_once
from ..config.sections import TorchAutocastConfig

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(cfg: TorchAutocastConfig, device: torch.device) -> torch.dtype:
    """The configured dtype, else the device's autocast default (DeepSpeed passes None to torch.autocast)."""
    return _DTYPES[cfg.dtype] if cfg.dtype else torch.get_autocast_dtype(device.type)


def check_autocast(cfg: TorchAutocastConfig, device: torch.device) -> None:
    """Refuse what shardwise cannot run, on every rank alike, before anything is built."""
    if not cfg.enabled:
        return
    problems = []
    if autocast_dtype(cfg, device) == torch.float16:
        problems.append(f"torch_autocast.dtype: a DeepSpeed setting that shardwise does not implement yet for float16 "
                        f"(it needs a gradient scaler); got none, which means float16 on {device.type}. Set "
                        '"dtype": "bfloat16", or use fp16.enabled.')
    for name in cfg.lower_precision_safe_modules or []:
        package, _, cls = name.rpartition(".")
        try:
            getattr(importlib.import_module(package), cls)
        except (ImportError, AttributeError, ValueError):
            problems.append(f"torch_autocast.lower_precision_safe_modules: {name!r} does not import; give a module "
                            'class by its full name, e.g. "torch.nn.modules.linear.Linear".')
    if problems:
        raise ConfigError(problems)


AUTOCAST_AS_IS: ContextManager[None] = contextlib.nullcontext()
"""What the forward's factory returns when autocast is neither on in the config nor on around the engine: the
engine recognises it by identity and enters no context."""


def forward_autocast(cfg: TorchAutocastConfig, device: torch.device) -> Callable[[], ContextManager[None]]:
    """A factory of the context the engine's forward runs in."""
    if cfg.enabled:
        dtype = autocast_dtype(cfg, device)
        return lambda: torch.autocast(device.type, dtype=dtype)

    def outer_autocast_off() -> ContextManager[None]:
        if not torch.is_autocast_enabled(device.type):
            return AUTOCAST_AS_IS
        note_once(logger, logging.WARNING,
                  "torch.autocast is on around the engine but torch_autocast is not enabled in the config: the engine's "
                  "forward runs without it (fp16/bf16.enabled set its precision), as in DeepSpeed. Enable torch_autocast "
                  "in the config to run under autocast.")
        return torch.autocast(device.type, enabled=False)

    return outer_autocast_off
