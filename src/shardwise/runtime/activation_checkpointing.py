"""Activation checkpointing: DeepSpeed's `deepspeed.checkpointing` API on `torch.utils.checkpoint`.

A model opts in by calling `checkpoint(function, *args)` (as Megatron-style models call
`deepspeed.checkpointing.checkpoint`), or hands a `Checkpointer` to Hugging Face as its gradient
checkpointing function (`use_hf_layers`). `function` runs without keeping its activations and is
recomputed in backward. The reentrant flavour is used: it recomputes under a backward of its own,
whose graph carries the ZeRO-3 hooks, so partitioned parameters are gathered again for the recompute.

What each key of the config's `activation_checkpointing` section does here:

- `cpu_checkpointing`: the inputs kept for the recompute (the only tensors checkpointing keeps) live in
  host memory until backward (`torch.autograd.graph.save_on_cpu`).
- `partition_activations`: DeepSpeed splits those inputs across the model-parallel group. shardwise has
  no tensor parallelism yet, so that group has one rank and there is nothing to split, as in DeepSpeed
  with a model-parallel size of 1.
- `contiguous_memory_optimization`, `number_checkpoints`: DeepSpeed copies the kept inputs into one
  preallocated buffer against fragmentation; torch's caching allocator already reuses those blocks, so
  shardwise does not act on them (a one-time warning says so; neither changes what is computed).
- `synchronize_checkpoint_boundary`: the device is synchronised before and after each checkpointed call.
- `profile`: each checkpointed forward's wall time is logged.

`configure` sets the one default `Checkpointer` that the module-level `checkpoint` uses: DeepSpeed's
API passes no engine, so, as with `GatheredParameters`' registry, this is a deliberate module-level
setting.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from .. import accelerator
from ..config.sections import ActivationCheckpointingConfig

logger = logging.getLogger(__name__)


class Checkpointer:
    """Recomputes a function's activations in backward, as one `activation_checkpointing` section says."""

    def __init__(self, config: ActivationCheckpointingConfig | None = None):
        self.config = config or ActivationCheckpointingConfig()
        self.calls = 0
        if self.config.contiguous_memory_optimization or self.config.number_checkpoints is not None:
            logger.warning("activation_checkpointing.contiguous_memory_optimization / number_checkpoints: not acted "
                           "on (torch's caching allocator reuses the blocks); checkpointing itself is unchanged.")

    def __call__(self, function: Callable[..., Any], *args: Any) -> Any:
        self.calls += 1
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        if self.config.synchronize_checkpoint_boundary:
            accelerator.synchronize(device)
        start = time.perf_counter()
        keep = (torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda") if self.config.cpu_checkpointing
                else contextlib.nullcontext())
        with keep:
            out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)
        if self.config.synchronize_checkpoint_boundary:
            accelerator.synchronize(device)
        if self.config.profile:
            logger.info("activation checkpoint %d: forward %.2f ms", self.calls, 1e3 * (time.perf_counter() - start))
        return out


_default = Checkpointer()
_configured = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, config: ActivationCheckpointingConfig | None = None,
              **overrides: Any) -> Checkpointer:
    """DeepSpeed's `checkpointing.configure`: from a section object, a full config (dict, JSON path or
    parsed `Config`), or keyword overrides in DeepSpeed's spelling (`partition_activations`,
    `contiguous_checkpointing`, `num_checkpoints`, `checkpoint_in_cpu`, `synchronize`, `profile`)."""
    global _default, _configured
    if mpu_ is not None:
        raise ValueError("configure(mpu_=...): model-parallel units are not supported yet; pass None.")
    if config is None and deepspeed_config is not None:
        config = _section_of(deepspeed_config)
    fields = dict((config or ActivationCheckpointingConfig()).model_dump())
    renames = {"contiguous_checkpointing": "contiguous_memory_optimization", "num_checkpoints": "number_checkpoints",
               "checkpoint_in_cpu": "cpu_checkpointing", "synchronize": "synchronize_checkpoint_boundary"}
    for key, value in overrides.items():
        if value is not None:
            fields[renames.get(key, key)] = value
    _default = Checkpointer(ActivationCheckpointingConfig.model_validate(fields))
    _configured = True
    return _default


def _section_of(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    from ..config import Config, parse_config

    parsed = deepspeed_config if isinstance(deepspeed_config, Config) else parse_config(deepspeed_config)
    return parsed.activation_checkpointing


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed calls this between steps to free its contiguous buffers; there are none here."""


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's `checkpointing.checkpoint(function, *args)`, with the configured settings."""
    return _default(function, *args)


def use_hf_layers(model: torch.nn.Module, checkpointer: Checkpointer) -> None:
    """Checkpoint every decoder layer of a Hugging Face model with `checkpointer` (its own recompute
    machinery, with shardwise's settings), and make the embedding output require grad, which
    reentrant checkpointing needs when the embeddings are frozen (LoRA)."""
    set_checkpointing = getattr(model, "_set_gradient_checkpointing", None)
    if set_checkpointing is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise TypeError(f"use_hf_layers: {type(model).__name__} is not a Hugging Face model that supports gradient "
                        "checkpointing; call shardwise's checkpoint(function, *args) in its forward instead.")
    set_checkpointing(enable=True, gradient_checkpointing_func=checkpointer)
    if getattr(model, "_require_grads_hook", None) is None:
        model.enable_input_require_grads()
    model.config.use_cache = False
