"""`zero.Init` (partition a model while it is built) and `GatheredParameters` (see whole parameters).

Inside `Init`, every module's parameters are partitioned as soon as that module's constructor
returns: each rank keeps `ceil(numel / N)` elements of each parameter, so building an N-layer model
peaks at about 1/N of it plus its largest layer. The engine later regroups these slices into units.
Torch is patched only inside the context manager (module constructors are wrapped) and restored on
exit, even on error.

A Hugging Face model re-initialises its submodules at the end of its constructor (`post_init`), when they
are already partitioned; `hf_init.py` makes that work a module at a time on gathered parameters. Pretrained
weights are then streamed in with `load_state_dict_partitioned`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ... import accelerator
from ...distributed import Collectives, Group, init_distributed
from ..edits import take_edits
from .ds_attributes import mark_partitioned
from .hf_init import partitioned_hf_initialisation
from .registry import INIT_SHARD_OF, REPLICATED_OWNER, UNIT_OF, InitShard
from .unit import held


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found.add(sub)
        found |= _subclasses(sub)
    return found


class Init(contextlib.ContextDecorator):
    """DeepSpeed's `zero.Init(config_dict_or_path=..., enabled=True)`."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 config_dict_or_path: str | Path | Mapping[str, Any] | None = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, **unused: Any):
        self.enabled = enabled
        self._originals: dict[type, Any] = {}
        self._depth: dict[int, int] = {}

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        init_distributed()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.group = Group("data", dist.group.WORLD, world, rank)
        self.comm = Collectives()
        self.device = accelerator.device_for(int(os.environ.get("LOCAL_RANK", 0)))
        for cls in _subclasses(torch.nn.Module) | {torch.nn.Module}:
            self._wrap(cls)
        # Classes defined inside the block are wrapped as they are created.
        self._had_init_subclass = "__init_subclass__" in torch.nn.Module.__dict__
        self._init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        torch.nn.Module.__init_subclass__ = classmethod(lambda cls, **kw: self._wrap(cls))  # type: ignore[assignment]
        self._hf = contextlib.ExitStack()
        self._hf.enter_context(partitioned_hf_initialisation(is_partitioned, GatheredParameters))
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        self._hf.close()
        if self._had_init_subclass:
            torch.nn.Module.__init_subclass__ = self._init_subclass  # type: ignore[assignment]
        else:
            del torch.nn.Module.__init_subclass__
        for cls, original in self._originals.items():
            cls.__init__ = original
        self._originals.clear()

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or cls in self._originals:
            return
        self._originals[cls] = original

        @functools.wraps(original)
        def init(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            self._depth[key] = self._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                self._depth[key] -= 1
                if self._depth[key] == 0:
                    del self._depth[key]
                    self._partition(module)

        cls.__init__ = init

    def _partition(self, module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if p in INIT_SHARD_OF or p.numel() == 0:
                continue
            chunk = math.ceil(p.numel() / self.group.size)
            shard = torch.zeros(chunk, dtype=torch.float32, device=self.device)
            entry = InitShard(p.shape, p.numel(), shard, self.group, self.comm)
            entry.write_back(p.detach())
            INIT_SHARD_OF[p] = entry
            mark_partitioned(p)
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)


def is_partitioned(param: torch.nn.Parameter) -> bool:
    return param in INIT_SHARD_OF or param in UNIT_OF


class GatheredParameters(contextlib.AbstractContextManager):
    """Whole parameters inside the block; with `modifier_rank`, that rank's changes are kept everywhere, in the
    fp32 masters too ([Note: edits reach the masters] in zero/edits.py); without it changes to partitioned
    parameters are dropped (as in DeepSpeed).

    A collective: every rank must enter it with the same parameters. Parameters that are not partitioned (stages
    0-2, or no engine) are already whole; with `modifier_rank` those of an engine are broadcast from that rank on
    exit. Tensors taken from the parameters inside the block (`p.data`, `p.detach()`) stay valid after it: the
    gathered storage is left to them rather than freed in place.
    """

    def __init__(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.params: list[torch.nn.Parameter] = []
        self.replicated: list[torch.nn.Parameter] = []
        for p in params if enabled else []:
            if is_partitioned(p) and all(p is not q for q in self.params):
                self.params.append(p)
            elif p in REPLICATED_OWNER and all(p is not q for q in self.replicated):
                self.replicated.append(p)
        self.modifier_rank = modifier_rank
        self._units: list[Any] = []
        self._gathered: list[tuple[torch.nn.Parameter, torch.dtype]] = []  # zero.Init parameters this block gathered
        self._hold: contextlib.AbstractContextManager = contextlib.nullcontext()

    def __enter__(self) -> GatheredParameters:
        self._units = []
        for p in self.params:
            unit = UNIT_OF.get(p)
            if unit is not None and all(unit is not u for u in self._units):
                self._units.append(unit)
        self._hold = held(self._units, keep_copies=True)
        self._hold.__enter__()
        for p in self.params:
            entry = INIT_SHARD_OF.get(p)
            if entry is not None and not entry.gathered:  # else an enclosing block holds it
                self._gathered.append((p, p.dtype))
                p.data = entry.gather().to(p.dtype)  # the shard is fp32; the parameter keeps its dtype
                entry.gathered = True
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            if self.modifier_rank is not None:
                self._broadcast_changes()
                self._keep_replicated_edits()
            for p, dtype in self._gathered:
                entry = INIT_SHARD_OF[p]
                if self.modifier_rank is not None:
                    entry.write_back(p.data)
                entry.gathered = False
                p.data = torch.empty(0, dtype=dtype, device=p.device)
            self._gathered = []
        self._hold.__exit__(*exc)

    def _broadcast_changes(self) -> None:
        inexact = [u.module_name for u in self._units if not u.exact]
        if inexact:
            raise RuntimeError(
                f"GatheredParameters(modifier_rank={self.modifier_rank}): the weights of {inexact[:3]} were gathered "
                "for a running forward as zero_quantized_weights' int8 approximation; writing them back would replace "
                "the master weights with it. Modify parameters outside the model's forward.")
        for p in self.params:
            owner = UNIT_OF.get(p) or INIT_SHARD_OF[p]
            owner.comm.broadcast(p.data, self.modifier_rank, owner.group).wait()
        for unit in self._units:
            lo, hi = unit.layout.shard_range(unit.group.rank, unit.group.size)
            if unit.master is not None:
                with unit_master_resident(unit):
                    take_edits(unit.master, unit.full[lo:hi])
            if not unit.aliased:
                unit.home.store(unit.index, unit.shard, unit.full[lo:hi])
            unit.drop_secondary()

    def _keep_replicated_edits(self) -> None:
        by_owner: dict[int, tuple[Any, list[torch.nn.Parameter]]] = {}
        for p in self.replicated:
            owner = REPLICATED_OWNER[p]()
            if owner is not None:  # else its engine is gone: nothing holds a master
                by_owner.setdefault(id(owner), (owner, []))[1].append(p)
        for owner, params in by_owner.values():
            owner.keep_edits(params, self.modifier_rank)


def unit_master_resident(unit: Any) -> contextlib.AbstractContextManager:
    """The master slice in memory: with NVMe offload the whole optimizer side is read in (rare: only
    a modifying GatheredParameters needs it)."""
    return unit.offload.resident() if unit.offload is not None else contextlib.nullcontext()


def load_state_dict_partitioned(module: torch.nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Stream a full state dict into a model partitioned by `zero.Init`, one tensor at a time.

    Each rank keeps only its slice of each tensor, so no rank ever holds the whole model.
    """
    named = dict(module.named_parameters())
    missing = [n for n in named if n not in state]
    if strict and missing:
        raise KeyError(f"load_state_dict_partitioned: missing {missing[:10]}; pass strict=False to skip them.")
    shapes = {n: (INIT_SHARD_OF[p].shape if p in INIT_SHARD_OF else p.shape) for n, p in named.items()}
    check_shapes("load_state_dict_partitioned", {**shapes, **{n: b.shape for n, b in module.named_buffers()}}, state)
    with torch.no_grad():
        for name, p in named.items():
            if name not in state:
                continue
            if p in INIT_SHARD_OF:
                INIT_SHARD_OF[p].write_back(state[name])
            elif p in UNIT_OF:
                raise ValueError(f"{name}: the model is already inside an engine; use engine.load_checkpoint "
                                 "or engine.strategy.load_module_state_dict instead.")
            else:
                p.copy_(state[name])
        buffers = {k: v for k, v in state.items() if k not in named}
        module.load_state_dict(buffers, strict=False)


def check_shapes(where: str, model: Mapping[str, Sequence[int]], state: Mapping[str, torch.Tensor]) -> None:
    """Refuse a state dict any of whose tensors has another shape than the model's, listing them all.

    Streaming by element range would otherwise copy a larger tensor's first elements, or a smaller one
    into the start of the parameter, without a word. strict=False skips missing names, never a different
    shape. Checked before anything is written, and identically on every rank (same model, same state).
    """
    differ = [f"{name!r}: state dict {tuple(state[name].shape)}, model {tuple(shape)}"
              for name, shape in model.items() if name in state and tuple(state[name].shape) != tuple(shape)]
    if differ:
        raise ValueError(f"{where}: {len(differ)} shape(s) differ between the state dict and the model: "
                         f"{'; '.join(differ)}. Load a state dict of a model built with the same configuration.")
