"""The one no-op context every disabled instrument returns: the engine's hot path recognises it by
identity (`is NOTHING`) and pays neither for building nor for entering a context."""

from __future__ import annotations

import contextlib
from typing import ContextManager

NOTHING: ContextManager[None] = contextlib.nullcontext()
