"""Random layerwise token dropping (random-LTD, arXiv 2211.11586): the layers `random_ltd_layer_id` of the model's
layer list see, in training, `kept_tokens(schedule, step)` random tokens of each sequence; the rest bypass them.

`attach_random_ltd` (called by `shardwise.initialize` before the sharding strategy wraps the model) finds the layer
list and attaches a `TokenDropLayer` to each chosen layer (token_drop.py: no wrapper module, so parameter names do
not change); it returns the `RandomLTDScheduler` the engine tells the step at every training forward, which is
also DeepSpeed's `engine.random_ltd_scheduler`. Everything is a pure function of the optimizer step (the kept
count, the consumed layer tokens, the drawn positions), so a checkpoint needs nothing beyond the step it has.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.data_efficiency import RandomLTDConfig
from .schedule import kept_tokens
from .token_drop import TokenDropLayer


class RandomLTDError(ValueError):
    """A random-LTD setting that does not fit the model."""


class RandomLTDScheduler:
    """The kept-token count at the current step, and the layers that use it (DeepSpeed's accessors)."""

    def __init__(self, config: RandomLTDConfig, seed: int, dp_rank: int, global_batch_size: int):
        assert config.random_ltd_schedule is not None  # checked by the config when enabled
        self.config, self.schedule = config, config.random_ltd_schedule
        self.seed, self.dp_rank, self.global_batch_size = seed, dp_rank, global_batch_size
        self.current_step, self.micro_step = -1, 0
        """The optimizer step (and micro-step in its window) of the last training forward; -1 before any."""
        self.layers: list[TokenDropLayer] = []
        self.total_layer_num: int | None = None
        self.pending_error: str | None = None
        """Why no layers could be attached at initialize: raised at the first training forward unless
        `convert` attaches them before (DeepSpeed scripts call convert_to_random_ltd after initialize)."""

    # --- the engine's side ----------------------------------------------------------------------
    def update_seq(self, global_steps: int, micro_step: int = 0) -> None:
        """Called by the engine before each training forward."""
        if self.pending_error is not None:
            raise RandomLTDError(self.pending_error)
        self.current_step, self.micro_step = global_steps, micro_step

    def draw_key(self) -> tuple[int, int, int, int]:
        return self.seed, max(self.current_step, 0), self.micro_step, self.dp_rank

    # --- DeepSpeed's RandomLTDScheduler surface ------------------------------------------------------
    def get_current_seq(self) -> int:
        return kept_tokens(self.schedule, max(self.current_step, 0))

    def get_random_ltd_layer_num(self) -> int:
        return len(self.config.random_ltd_layer_id)

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer tokens of `train_iters` steps: global batch × (kept × random-LTD layers + max × the others)."""
        return self._layer_tokens(train_iters)

    @property
    def consumed_layer_tokens(self) -> int:
        """Layer tokens of the steps up to and including the current one (as DeepSpeed counts at the forward)."""
        return self._layer_tokens(self.current_step + 1)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_layer_tokens": self.consumed_layer_tokens, "current_steps": self.current_step,
                "current_value": self.get_current_seq(), "min_value": self.schedule.min_value,
                "max_value": self.schedule.max_value}

    def get_state(self) -> dict[str, int]:
        """DeepSpeed's `state` dict, read-only here (scripts read `consumed_layer_tokens` from it)."""
        return self.state_dict()

    state = property(get_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes the step; the rest follows from it (the schedule is a pure function of the step)."""
        if (state.get("min_value"), state.get("max_value")) != (self.schedule.min_value, self.schedule.max_value):
            raise RandomLTDError(f"random_ltd state: min_value/max_value must match this run's schedule "
                                 f"({self.schedule.min_value}, {self.schedule.max_value}); got "
                                 f"({state.get('min_value')}, {state.get('max_value')}).")
        self.current_step = int(state["current_steps"])

    def _layer_tokens(self, steps: int) -> int:
        ltd = self.get_random_ltd_layer_num()
        total = self.total_layer_num if self.total_layer_num is not None else (self.config.total_layer_num or ltd)
        full = self.schedule.max_value * (total - ltd)
        kept, step = 0, 0
        while step < steps:  # the count rises to max_value, then stays there
            now = kept_tokens(self.schedule, step)
            if now >= self.schedule.max_value:
                break
            kept, step = kept + now, step + 1
        kept += self.schedule.max_value * (steps - step)
        return self.global_batch_size * (kept * ltd + full * steps)

    # --- attaching ---------------------------------------------------------------------------------
    def convert(self, model: torch.nn.Module, layer_type: type | tuple[type, ...] | None = None) -> None:
        """Attach to the chosen layers of `model` (its layer list: the modules of `layer_type` in order, or the
        one list of identical blocks found in it); replaces an earlier attachment."""
        self.detach()
        layers = _modules_of(model, layer_type) if layer_type is not None else find_layer_list(model)
        self._check_layers(model, layers)
        seq_first = self.config.hidden_state_order == "seq_batch_dim"
        for index in sorted(self.config.random_ltd_layer_id):
            self.layers.append(TokenDropLayer(layers[index], index, self, self.config.model_mask_name, seq_first))
        self.total_layer_num, self.pending_error = len(layers), None

    def detach(self) -> None:
        for layer in self.layers:
            layer.detach()
        self.layers = []

    def _check_layers(self, model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
        ids, count = self.config.random_ltd_layer_id, len(layers)
        if self.config.total_layer_num is not None and self.config.total_layer_num != count:
            raise RandomLTDError(f"random_ltd.total_layer_num: must equal the number of layers of "
                                 f"{type(model).__name__} ({count}, {type(layers[0]).__name__}); got "
                                 f"{self.config.total_layer_num}. Set it to {count} or drop the key.")
        if max(ids) >= count:
            raise RandomLTDError(f"random_ltd.random_ltd_layer_id: indices into the {count} layers of "
                                 f"{type(model).__name__} (0 to {count - 1}) are required; got {ids}. Drop "
                                 f"{[i for i in ids if i >= count]}.")


def attach_random_ltd(model: torch.nn.Module, config: Any, dp_rank: int) -> RandomLTDScheduler | None:
    """The scheduler with its layers attached when `config.data_efficiency.random_ltd` is on, else None.
    `config` is the root Config (random-LTD reads data_efficiency, the batch size and tensor_parallel)."""
    ltd = config.data_efficiency.random_ltd
    if ltd is None:
        return None
    if config.tensor_parallel.sequence_parallel:
        raise RandomLTDError("data_efficiency.data_routing.random_ltd: not supported with "
                             "tensor_parallel.sequence_parallel (each rank holds part of the sequence); got both. "
                             "Turn one of them off.")
    if hasattr(model, "num_stages"):
        raise RandomLTDError(f"data_efficiency.data_routing.random_ltd: not supported with a PipelineModule; got "
                             f"{type(model).__name__}. Train without pipeline stages or drop random_ltd.")
    scheduler = RandomLTDScheduler(ltd, config.data_efficiency.seed, dp_rank, config.train_batch_size)
    try:
        scheduler.convert(model)
    except LayerListNotFound as e:
        scheduler.pending_error = str(e)
    return scheduler


def convert_to_random_ltd(engine: Any, layer_type: type | tuple[type, ...]) -> Any:
    """Attach random-LTD to the modules of `layer_type` of `engine.module` (in order: the layer list that
    random_ltd_layer_id indexes), replacing what initialize attached; DeepSpeed-Chat calls this after initialize."""
    scheduler = getattr(engine, "random_ltd_scheduler", None)
    if scheduler is None:
        raise RandomLTDError("convert_to_random_ltd: needs data_efficiency.data_routing.random_ltd enabled in the "
                             f"config of the engine; got {type(engine).__name__} without it. Enable it (with "
                             "data_efficiency.enabled and data_routing.enabled).")
    scheduler.convert(engine.module, layer_type)
    return engine


def remove_random_ltd_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict as a model without random-LTD names it: unchanged, as random-LTD adds no name level
    (token_drop.py, [Note: random-LTD without a wrapper module])."""
    return dict(state_dict)


def save_without_random_ltd(model: torch.nn.Module) -> dict[str, Any]:
    return remove_random_ltd_state_dict(getattr(model, "module", model).state_dict())


class LayerListNotFound(RandomLTDError):
    pass


def find_layer_list(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer layers: the one outermost nn.ModuleList whose items are all of one class
    (GPT-2's `transformer.h`, LLaMA's `model.layers`, BERT's `encoder.layer`)."""
    lists = {name: m for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(x) for x in m}) == 1}
    outer = [name for name in lists if not any(name.startswith(other + ".") for other in lists if other != name)]
    if len(outer) != 1:
        found = "none" if not outer else ", ".join(f"{n} ({len(lists[n])} x {type(lists[n][0]).__name__})" for n in outer)
        raise LayerListNotFound(
            f"random_ltd.random_ltd_layer_id: indexes the model's list of transformer layers, which must be the "
            f"one outermost nn.ModuleList of identical blocks in {type(model).__name__}; found {found}. Call "
            "deepspeed.runtime.data_pipeline.data_routing.helper.convert_to_random_ltd(engine, LayerClass) after "
            "initialize to name the layer class (its modules in order are the list), or drop random_ltd.")
    return list(lists[outer[0]])


def _modules_of(model: torch.nn.Module, layer_type: type | tuple[type, ...]) -> list[torch.nn.Module]:
    layers = [m for m in model.modules() if isinstance(m, layer_type)]
    if not layers:
        raise RandomLTDError(f"convert_type: no module of {layer_type} in {type(model).__name__}; pass the class "
                             "of the model's transformer layers.")
    return layers
