"""The flops profiler: the engine's (one profiled micro-batch at `profile_step`) and the standalone
`get_model_profile`, DeepSpeed's entry point, which profiles one forward of any module.

In the engine only the first micro-batch of optimizer step `profile_step` (counting from 0, so the
default 1 profiles the step after a warm-up step) runs under the counter; every other forward pays
two attribute checks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, ContextManager, Iterator, Sequence

import torch

from .. import accelerator
from ..config.monitoring import FlopsProfilerConfig
from .flops import FlopsSession, ModelProfile
from .flops_report import render
from .noop import NOTHING
from .units import si

logger = logging.getLogger("shardwise")


class FlopsProfiler:
    def __init__(self, config: FlopsProfilerConfig, device: torch.device, rank: int):
        self.config, self.device, self.rank = config, device, rank
        self.profile: ModelProfile | None = None
        """The finished profile (fwd + bwd FLOPs of one micro-batch), once the profile step is done."""
        self._session: FlopsSession | None = None
        self._step: int | None = None
        self._done = not config.enabled

    def forward(self, module: torch.nn.Module, global_steps: int) -> ContextManager[None]:
        if self._session is not None and self._session.open:
            self._finish()  # a second forward before backward: keep the forward-only profile
        if self._done or global_steps != self.config.profile_step:
            return NOTHING
        return self._profiled_forward(module, global_steps)

    @contextlib.contextmanager
    def _profiled_forward(self, module: torch.nn.Module, global_steps: int) -> Iterator[None]:
        self._session, self._step = FlopsSession(module, self.device), global_steps
        self._session.start_forward()
        try:
            yield
        except BaseException:
            self._session.close()  # never leave the counting mode on after a failed forward
            self._session, self._done = None, True
            raise
        self._session.end_forward()
        if not torch.is_grad_enabled():
            self._finish()

    def backward(self) -> ContextManager[None]:
        if self._session is None or not self._session.open:
            return NOTHING
        return self._profiled_backward(self._session)

    @contextlib.contextmanager
    def _profiled_backward(self, session: FlopsSession) -> Iterator[None]:
        session.start_backward()
        try:
            yield
        finally:
            session.end_backward()
            self._finish()

    def step(self) -> ContextManager[None]:
        """Around the optimizer step that ends the profiled step: times it, then reports."""
        if self.profile is None or self._step is None:
            return NOTHING
        return self._timed_step()

    @contextlib.contextmanager
    def _timed_step(self) -> Iterator[None]:
        accelerator.synchronize(self.device)
        start = time.perf_counter()
        yield
        accelerator.synchronize(self.device)
        assert self.profile is not None
        self.profile.step_latency_s = time.perf_counter() - start
        self._report()

    def _finish(self) -> None:
        assert self._session is not None
        self.profile = self._session.result()
        self._session = None
        self._done = True

    def _report(self) -> None:
        step, self._step = self._step, None
        if self.rank != 0 or self.profile is None:
            return
        text = render(self.profile, f"Profile of optimizer step {step}'s first micro-batch on rank {self.rank}",
                      self.config.module_depth, self.config.top_modules, self.config.detailed)
        _emit(text, self.config.output_file)


def _emit(text: str, output_file: str | None) -> None:
    if output_file:
        path = Path(output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    else:
        logger.info("\n%s", text)


def profile_model(model: torch.nn.Module, input_shape: Sequence[int] | None = None, args: Sequence[Any] | None = None,
                  kwargs: dict[str, Any] | None = None, warm_up: int = 1, backward: bool = False) -> ModelProfile:
    """Profile one call of `model` (after `warm_up` unprofiled calls); with `backward`, also the backward
    of its output (a scalar output, else the sum of the first floating tensor output)."""
    args, kwargs = _inputs(model, input_shape, args, kwargs)
    device = _device_of(model)
    with torch.set_grad_enabled(backward):
        for _ in range(warm_up):
            model(*args, **kwargs)
        session = FlopsSession(model, device)
        session.start_forward()
        try:
            output = model(*args, **kwargs)
        finally:
            session.end_forward()
        if backward:
            session.start_backward()
            _scalar(output).backward()
            session.end_backward()
    return session.result()


def get_model_profile(model: torch.nn.Module, input_shape: Sequence[int] | None = None,
                      args: Sequence[Any] | None = None, kwargs: dict[str, Any] | None = None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True, output_file: str | None = None,
                      ignore_modules: Sequence[type] | None = None, backward: bool = False) -> tuple[Any, Any, Any]:
    """DeepSpeed's standalone profiler: `(flops, macs, params)` of one forward of `model`.

    `input_shape` builds one floating tensor of that shape (ones) as the only argument; otherwise pass
    `args` / `kwargs`. With `as_string` the three figures come formatted ("1.2 GFLOPS"). `backward=True`
    also counts the backward (printed; the returned figures stay forward-only, as DeepSpeed's).
    `ignore_modules` hides modules of those types from the printed tree (their FLOPs stay in the totals).
    """
    profile = profile_model(model, input_shape, args, kwargs, warm_up, backward)
    if print_profile:
        ignore = tuple(t.__name__ for t in ignore_modules or ())
        _emit(render(profile, f"Profile of {type(model).__name__}", module_depth, top_modules, detailed, ignore),
              output_file)
    if as_string:
        return si(profile.fwd_flops, "FLOPS"), si(profile.fwd_macs, "MACs"), si(profile.params)
    return profile.fwd_flops, profile.fwd_macs, profile.params


def _inputs(model: torch.nn.Module, input_shape: Sequence[int] | None, args: Sequence[Any] | None,
            kwargs: dict[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("input_shape: give either input_shape or args/kwargs, not both.")
        param = next(model.parameters(), None)
        dtype = param.dtype if param is not None else torch.float32
        return (torch.ones(tuple(input_shape), dtype=dtype, device=_device_of(model)),), {}
    if not args and not kwargs:
        raise ValueError("get_model_profile: no input; pass input_shape=(batch, ...) or args=[...] / kwargs={...}.")
    return tuple(args or ()), dict(kwargs or {})


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _scalar(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().sum()
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point() and item.requires_grad:
            return _scalar(item)
    raise TypeError("backward=True: the model's output has no floating tensor to differentiate; "
                    f"got {type(output).__name__}.")
