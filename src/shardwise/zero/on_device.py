"""`OnDevice(dtype, device)`: build a model's parameters directly on a device (e.g. "meta") and in a dtype,
DeepSpeed's `deepspeed.OnDevice`; torch's device context and default dtype do the work."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class OnDevice(contextlib.ContextDecorator):
    def __init__(self, dtype: torch.dtype | None = None, device: str | torch.device = "meta", enabled: bool = True):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype=...): a floating-point dtype; got {dtype}.")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._stack.enter_context(self.device)
            if self.dtype is not None:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
                self._stack.callback(torch.set_default_dtype, previous)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
