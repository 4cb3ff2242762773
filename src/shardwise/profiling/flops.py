"""Counting a model's FLOPs per module, forward and backward, with `torch.utils.flop_counter`, and
timing each module's forward.

What is counted is what `FlopCounterMode` counts: matrix products (mm, addmm, bmm, baddbmm),
convolutions and scaled-dot-product attention, 2 FLOPs per multiply-accumulate (so MACs = FLOPs / 2);
bias adds, normalisations, activations and softmax are not counted. torch 2.13 has no formula for
the CPU flash-attention kernels, so `EXTRA_FORMULAS` maps them to torch's own attention formulas.

[Note: one counter across forward and backward] The counter attributes backward FLOPs to modules
through hooks it places on forward outputs, so one counter must stay open from the start of forward
to the end of backward; the forward counts are snapshot when forward ends and the backward ones are
the difference.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .. import accelerator


def _sdpa_forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _sdpa_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                   **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    aten = torch.ops.aten
    table: dict[Any, Callable[..., int]] = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward)):
        if hasattr(aten, name):
            table[getattr(aten, name)] = formula
    return table


EXTRA_FORMULAS = _extra_formulas()


@dataclass
class ModuleProfile:
    """One module's figures; FLOPs and latency include its submodules'."""

    name: str
    """Dotted path from the root ("" for the root itself)."""
    type_name: str
    depth: int
    params: int
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_latency_s: float = 0.0
    calls: int = 0

    @property
    def fwd_macs(self) -> int:
        return self.fwd_flops // 2

    @property
    def fwd_flops_per_s(self) -> float:
        return self.fwd_flops / self.fwd_latency_s if self.fwd_latency_s > 0 else 0.0


@dataclass
class ModelProfile:
    modules: dict[str, ModuleProfile]
    """In `named_modules()` order, the root first under ""."""
    fwd_flops: int
    bwd_flops: int
    fwd_latency_s: float
    bwd_latency_s: float | None = None
    step_latency_s: float | None = None
    by_op: dict[str, int] = field(default_factory=dict)
    """Forward + backward FLOPs per aten op."""

    @property
    def params(self) -> int:
        return self.modules[""].params

    @property
    def fwd_macs(self) -> int:
        return self.fwd_flops // 2

    @property
    def flops(self) -> int:
        """Forward plus backward FLOPs of the profiled micro-batch."""
        return self.fwd_flops + self.bwd_flops


class ModuleTimer:
    """Forward latency of every module, by hooks placed for one profiled forward."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.device = device
        self.latency_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._starts: dict[str, list[float]] = defaultdict(list)
        self._handles = []
        for name, sub in module.named_modules():
            self._handles.append(sub.register_forward_pre_hook(self._pre(name)))
            self._handles.append(sub.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            accelerator.synchronize(self.device)
            self._starts[name].append(time.perf_counter())

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            accelerator.synchronize(self.device)
            if self._starts[name]:
                self.latency_s[name] += time.perf_counter() - self._starts[name].pop()
                self.calls[name] += 1

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _module_counts(counts: dict[str, dict[Any, int]], root: str) -> dict[str, int]:
    """Counter names ("GPT.blocks.0") → our dotted paths ("blocks.0"), FLOPs summed over ops."""
    out: dict[str, int] = {}
    for name, per_op in counts.items():
        if name == root:
            out[""] = sum(per_op.values())
        elif name.startswith(root + "."):
            out[name[len(root) + 1 :]] = sum(per_op.values())
    return out


def _subtree_params(module: torch.nn.Module) -> dict[str, int]:
    """Parameters under each module, each parameter once (a tied weight counts where first seen)."""
    return {name: sum(p.numel() for p in sub.parameters()) for name, sub in module.named_modules()}


def _fill_containers(modules: dict[str, ModuleProfile]) -> None:
    """A module never called (a ModuleList, a Sequential used by index) shows the sum of its children."""
    children: dict[str, list[ModuleProfile]] = defaultdict(list)
    for m in modules.values():
        if m.name:
            children[m.name.rsplit(".", 1)[0] if "." in m.name else ""].append(m)
    for m in sorted(modules.values(), key=lambda m: -m.depth):  # deepest first: nested containers add up
        if m.calls == 0 and m.name and children[m.name]:
            m.fwd_flops = sum(c.fwd_flops for c in children[m.name])
            m.bwd_flops = sum(c.bwd_flops for c in children[m.name])
            m.fwd_latency_s = sum(c.fwd_latency_s for c in children[m.name])


class FlopsSession:
    """One profiled forward (and optionally its backward): see [Note: one counter across forward and backward]."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module, self.device = module, device
        self.counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)
        self.timer: ModuleTimer | None = None
        self._forward_counts: dict[str, dict[Any, int]] = {}
        self._fwd_latency_s = 0.0
        self._bwd_latency_s: float | None = None
        self._t0 = 0.0
        self.open = False

    def start_forward(self) -> None:
        self.counter.__enter__()
        self.open = True
        self.timer = ModuleTimer(self.module, self.device)
        accelerator.synchronize(self.device)
        self._t0 = time.perf_counter()

    def end_forward(self) -> None:
        accelerator.synchronize(self.device)
        self._fwd_latency_s = time.perf_counter() - self._t0
        assert self.timer is not None
        self.timer.remove()
        self._forward_counts = copy.deepcopy(self.counter.get_flop_counts())

    def start_backward(self) -> None:
        accelerator.synchronize(self.device)
        self._t0 = time.perf_counter()

    def end_backward(self) -> None:
        accelerator.synchronize(self.device)
        self._bwd_latency_s = time.perf_counter() - self._t0
        self.close()

    def close(self) -> None:
        if self.open:
            self.open = False
            self.counter.__exit__(None, None, None)

    def result(self) -> ModelProfile:
        self.close()
        root = type(self.module).__name__
        everything = self.counter.get_flop_counts()
        fwd = _module_counts(self._forward_counts, root)
        total = _module_counts(everything, root)
        params = _subtree_params(self.module)
        assert self.timer is not None
        modules = {}
        for name, sub in self.module.named_modules():
            modules[name] = ModuleProfile(
                name=name, type_name=type(sub).__name__, depth=0 if not name else name.count(".") + 1,
                params=params[name], fwd_flops=fwd.get(name, 0), bwd_flops=total.get(name, 0) - fwd.get(name, 0),
                fwd_latency_s=self.timer.latency_s.get(name, 0.0), calls=self.timer.calls.get(name, 0),
            )
        _fill_containers(modules)
        global_fwd = sum(self._forward_counts.get("Global", {}).values())
        global_all = sum(everything.get("Global", {}).values())
        by_op: dict[str, int] = defaultdict(int)
        for op, n in everything.get("Global", {}).items():
            by_op[str(op).removeprefix("aten.")] += n
        return ModelProfile(modules, global_fwd, global_all - global_fwd, self._fwd_latency_s, self._bwd_latency_s,
                            by_op=dict(by_op))
