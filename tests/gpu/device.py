"""World size 1 on this machine's device, for the device suite (`make test-gpu`): CUDA with NCCL when a GPU is
visible, else the CPU with gloo, so that every test whose logic does not need CUDA also runs in CI and stays
honest there. Only what needs CUDA itself (streams, CUDA graphs, pinned memory, flex_attention's backward) is
marked `gpu` and skipped without one.

Each body runs in a child process of its own: the engine's process group and environment never leak between
tests. CUDA children are spawned (a forked child cannot use CUDA once the pytest parent has touched it), so the
body must be a module-level function; CPU children are forked (no re-import of torch)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.harness import run_distributed

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device (runs in `make test-gpu`)")]
"""`pytestmark = needs_cuda` (a module) or `@pytest.mark.parametrize(..., marks=needs_cuda)`."""


def on_device(fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on one rank of a world of 1 on DEVICE (NCCL on CUDA, gloo on the CPU); its result."""
    return run_distributed(fn, 1, *args, timeout=timeout, start_method="spawn" if CUDA else "fork", **kwargs)[0]


def device_of(engine: Any) -> str:
    """The engine's device type, so a test can assert that it really ran where it was meant to."""
    return torch.device(engine.device).type
