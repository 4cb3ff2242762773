"""`PipelineModule`, `LayerSpec`, `TiedLayerSpec`: a model as a list of layers, of which each pipeline stage
builds and holds only its own part (DeepSpeed's `deepspeed.pipe` API).

Names do not depend on the partition: a layer is registered under its index in the whole list ("3.weight")
and a tied module under `tied_modules.<key>`, so a checkpoint written at one pipeline degree loads at another.

[Note: tied weights across stages] A `TiedLayerSpec` key used on several stages (an embedding shared by the
first and the last) is built on each of them. The lowest of those stages owns it: only there is it a
parameter, trained by the sharding strategy, saved and counted in the gradient norm once. On the other stages
the tied attributes are plain tensors that require gradients: their gradients are sent to the owner before its
last backward and join its own, and the owner sends the updated weights back after each step
(`pipeline/tied.py`). One copy of the optimizer state instead of one per stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ..distributed import init_distributed
from ..distributed.topology import PipeDataParallelTopology, ProcessTopology
from . import partition


class LayerSpec:
    """A layer to build later, on the stage that holds it: `LayerSpec(nn.Linear, 512, 512)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise TypeError(f"LayerSpec: an nn.Module class is required as the first argument; got {typename!r}.")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every `TiedLayerSpec` with the same `key` (see [Note: tied weights
    across stages]). `forward_fn(module, inputs)` lets a later use call the module differently (an output
    projection through the embedding's weight); `tied_weight_attr` names the shared tensors."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable[..., Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


class PipelineModule(torch.nn.Module):
    """The layers of one pipeline stage, chosen from the whole list by `partition_method`:
    "parameters" (balance trainable parameter counts), "uniform" (layer counts) or "type:<regex>" (layers
    whose class matches). `num_chunks` > 1 (shardwise) gives each stage that many parts for the interleaved
    schedule: stage `s` holds parts `s, s + stages, ...`."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = checkpoint,
                 checkpointable_layers: Sequence[str] | None = None, num_chunks: int = 1, **unused: Any):
        super().__init__()
        if unused:
            raise TypeError(f"PipelineModule: unknown arguments {sorted(unused)}.")
        if not dist.is_initialized():
            init_distributed()
        self.topology_ = _topology(num_stages, topology)
        self.num_stages = self.topology_.get_dim("pipe")
        self.stage_id = self.topology_.get_coord(dist.get_rank())["pipe"]
        self.num_chunks = num_chunks
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._layer_specs = list(layers)
        self.parts = self._partition(partition_method)
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_stages = _tied_stages(self._layer_specs, self.parts, self.num_stages)
        """Tied key -> the stages that use it, lowest (the owner) first."""
        self.tied_attrs = {spec.key: spec.tied_weight_attr for spec in self._layer_specs if isinstance(spec, TiedLayerSpec)}
        self._check_every_stage_has_parameters(partition_method)
        self.chunk_funcs: list[list[tuple[int, Callable[..., Any]]]] = [
            self._build(self.parts[v], self.parts[v + 1], seed_layers, seed_fn, base_seed)
            for v in self.virtual_stages()]
        self._detach_unowned_tied()

    # --- where this stage sits ----------------------------------------------------------
    def virtual_stages(self) -> list[int]:
        """The parts this stage holds, chunk by chunk."""
        return [c * self.num_stages + self.stage_id for c in range(self.num_chunks)]

    def topology(self) -> ProcessTopology:
        return self.topology_

    def partitions(self) -> list[int]:
        return list(self.parts)

    def owns_tied(self, key: str) -> bool:
        return self.tied_stages[key][0] == self.stage_id

    def tied_tensors(self, key: str) -> list[torch.Tensor]:
        """The tied module's shared tensors on this stage (parameters on the owner, plain tensors elsewhere)."""
        return [getattr(*_holder(self.tied_modules[key], attr)) for attr in self.tied_attrs[key]]

    def set_tied_tensor(self, key: str, index: int, tensor: torch.Tensor) -> None:
        setattr(*_holder(self.tied_modules[key], self.tied_attrs[key][index]), tensor)

    # --- forward --------------------------------------------------------------------------
    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        funcs = self.chunk_funcs[chunk]
        interval = self.activation_checkpoint_interval if self.training else 0
        if interval <= 0:
            return _run(funcs, inputs)
        x = inputs
        for start in range(0, len(funcs), interval):
            run = funcs[start : start + interval]
            if self._checkpointable(run):
                x = self.activation_checkpoint_func(functools.partial(_run, run), x, use_reentrant=False)
            else:
                x = _run(run, x)
        return x

    def _checkpointable(self, run: list[tuple[int, Callable[..., Any]]]) -> bool:
        if self.checkpointable_layers is None:
            return True
        return all(type(f).__name__ in self.checkpointable_layers for _, f in run)

    # --- building ---------------------------------------------------------------------------
    def _partition(self, method: str) -> list[int]:
        parts = self.num_stages * self.num_chunks
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise ValueError(f"num_chunks: a positive int is required; got {self.num_chunks!r}.")
        method = method.lower() if isinstance(method, str) else method
        if method == "uniform":
            return partition.uniform(len(self._layer_specs), parts)
        if method == "parameters":
            return partition.balanced([_trainable_count(s) for s in self._layer_specs], parts)
        if isinstance(method, str) and method.startswith("type:"):
            names = [_class_name(s) for s in self._layer_specs]
            return partition.balanced(partition.type_weights(names, method[len("type:"):]), parts)
        raise ValueError(f'partition_method: "parameters", "uniform" or "type:<regex>" is required; got {method!r}.')

    def _check_every_stage_has_parameters(self, method: str) -> None:
        """A stage without parameters gives its optimizer nothing to train. Every rank knows every stage's layers,
        so all refuse here together, rather than that stage's rank alone at initialize while the others wait."""
        counts = [_parameter_count(s) for s in self._layer_specs]
        empty = _stages_without_parameters(self._layer_specs, counts, self.parts, self.num_stages)
        if not empty:
            return
        stage = empty[0]
        held = [i for v in range(stage, len(self.parts) - 1, self.num_stages)
                for i in range(self.parts[v], self.parts[v + 1])]
        shown = ", ".join(f"{i}: {_describe(self._layer_specs[i], self.tied_stages)}" for i in held[:6])
        shown += f", ... ({len(held)} in all)" if len(held) > 6 else ""
        others = f" (so do stages {empty[1:]})" if len(empty) > 1 else ""
        working = [m for m in ("parameters", "uniform") if m != method
                   and not _stages_without_parameters(self._layer_specs, counts, self._partition(m), self.num_stages)]
        named = " or ".join(f'"{m}"' for m in working)
        if working:
            fix = (f"Use partition_method {named}, which puts parameters on every stage of this model, or "
                   '"type:<regex>" naming the layers that have parameters')
        else:
            fix = (f'Neither "parameters" nor "uniform" puts parameters on every one of the {self.num_stages} stages '
                   'of this model: use "type:<regex>" naming the layers that have parameters, fewer stages, or merge '
                   "the parameter-free layers into a neighbouring layer (a stage holds whole layers)")
        raise ValueError(f"PipelineModule: pipeline stage {stage} holds no parameters{others}: partition_method "
                         f'"{method}" gave it no layer with parameters of its own (layers {shown}), so its optimizer '
                         f"would have nothing to train. {fix}.")

    def _build(self, lo: int, hi: int, seed_layers: bool, seed_fn: Callable[[int], None] | None,
               base_seed: int) -> list[tuple[int, Callable[..., Any]]]:
        funcs = []
        for index in range(lo, hi):
            layer = self._layer_specs[index]
            if seed_layers:
                (seed_fn or torch.manual_seed)(base_seed + index)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                module = self.tied_modules[layer.key]
                funcs.append((index, functools.partial(layer.forward_fn, module) if layer.forward_fn else module))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(index), module)
                funcs.append((index, module))
            elif isinstance(layer, torch.nn.Module):
                self.add_module(str(index), layer)
                funcs.append((index, layer))
            elif callable(layer):
                funcs.append((index, layer))
            else:
                raise TypeError(f"layers[{index}]: a LayerSpec, an nn.Module or a callable is required; got "
                                f"{type(layer).__name__}.")
        return funcs

    def _detach_unowned_tied(self) -> None:
        for key in self.tied_modules:
            if self.owns_tied(key):
                continue
            for i, tensor in enumerate(self.tied_tensors(key)):
                module, attr = _holder(self.tied_modules[key], self.tied_attrs[key][i])
                del module._parameters[attr]
                self.set_tied_tensor(key, i, tensor.detach().requires_grad_(tensor.requires_grad))

    def describe(self) -> dict[str, Any]:
        """What every rank must agree on (the whole pipeline, whichever stage this is)."""
        return {"layers": [repr(s) if isinstance(s, LayerSpec) else type(s).__name__ for s in self._layer_specs],
                "parts": str(self.parts), "stages": str(self.num_stages), "chunks": str(self.num_chunks)}


def _run(funcs: list[tuple[int, Callable[..., Any]]], x: Any) -> Any:
    for _, func in funcs:
        x = func(x)
    return x


def _topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    world = dist.get_world_size()
    if topology is not None:
        if topology.world_size() != world:
            raise ValueError(f"topology: it describes {topology.world_size()} ranks, the world has {world}; build it "
                             "for this launch.")
        if num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(f"num_stages ({num_stages}) differs from the topology's pipe size "
                             f"({topology.get_dim('pipe')}); pass one of them.")
        return topology
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"PipelineModule: num_stages (a positive int) or topology is required; got {num_stages!r}.")
    if world % num_stages:
        raise ValueError(f"num_stages ({num_stages}) must divide the world size ({world}): the ranks split into "
                         "data-parallel replicas of the whole pipeline. Launch a multiple of num_stages processes.")
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


def _tied_stages(layers: list[Any], bounds: list[int], stages: int) -> dict[str, list[int]]:
    users: dict[str, set[int]] = {}
    for part in range(len(bounds) - 1):
        for index in range(bounds[part], bounds[part + 1]):
            if isinstance(layers[index], TiedLayerSpec):
                users.setdefault(layers[index].key, set()).add(part % stages)
    return {key: sorted(s) for key, s in users.items()}


def _trainable_count(layer: Any) -> int:
    """Trainable parameters of a layer, counted on the meta device (nothing is allocated or initialised)."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if isinstance(layer, torch.nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _parameter_count(layer: Any) -> int:
    """Every parameter of a layer, frozen or not (a stage of frozen layers is initialize's to refuse)."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    return sum(p.numel() for p in layer.parameters()) if isinstance(layer, torch.nn.Module) else 0


def _stages_without_parameters(layers: list[Any], counts: list[int], bounds: list[int], stages: int) -> list[int]:
    """The stages whose layers, over all their chunks, hold no parameter; a tied layer's are its owner's only."""
    owners = {key: users[0] for key, users in _tied_stages(layers, bounds, stages).items()}
    has = [False] * stages
    for part in range(len(bounds) - 1):
        stage = part % stages
        for index in range(bounds[part], bounds[part + 1]):
            layer = layers[index]
            if counts[index] and not (isinstance(layer, TiedLayerSpec) and owners[layer.key] != stage):
                has[stage] = True
    return [s for s in range(stages) if not has[s]]


def _describe(layer: Any, tied_stages: dict[str, list[int]]) -> str:
    if isinstance(layer, TiedLayerSpec):
        return f"{layer.typename.__name__} tied as {layer.key!r}, a parameter of stage {tied_stages[layer.key][0]} only"
    if isinstance(layer, (LayerSpec, torch.nn.Module)):
        return _class_name(layer)
    return getattr(layer, "__name__", type(layer).__name__)


def _class_name(layer: Any) -> str:
    return layer.typename.__name__ if isinstance(layer, LayerSpec) else type(layer).__name__


def _holder(module: torch.nn.Module, dotted: str) -> tuple[torch.nn.Module, str]:
    """The submodule that holds the attribute `dotted` ("weight", "proj.weight"), and the attribute's name."""
    owner, _, attr = dotted.rpartition(".")
    return module.get_submodule(owner), attr
