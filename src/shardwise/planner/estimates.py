"""DeepSpeed's model-state estimators (`estimate_zero{2,3}_model_states_mem_needs_all_{live,cold}`), answered
by the planner: per GPU and per node's CPU memory for each offload option, mixed-precision Adam training,
model states only (no activations), as DeepSpeed's print them.

The figures are the planner's parts for shardwise's runtime (plan.py), not DeepSpeed's formulas: the GPU
column adds what shardwise holds beside the states (gradient staging, ZeRO-3's window of the largest layer),
and the CPU column is the host part of every rank on a node times `additional_buffer_factor` (DeepSpeed's
margin for pinned buffers). `zero_init=0` loads the whole fp32 model in every process first, which the CPU
column then covers; `zero_init=1` (`zero.Init`, `from_pretrained` under a stage-3 config) does not.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .plan import MemoryPlan, plan
from .shape import ModelShape


def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total parameters, the largest module's own parameters), counting ZeRO-3 placeholders whole."""
    shape = ModelShape.of(model)
    return shape.total, max(shape.module_sizes, default=0)


def _cold_shape(total_params: int, largest_layer_params: int) -> ModelShape:
    # The largest layer as one unit, the rest in units of that size: the window and staging see the same peak.
    rest = max(total_params - largest_layer_params, 0)
    units = (largest_layer_params,) * (rest // max(largest_layer_params, 1)) + ((rest % largest_layer_params,)
                                                                               if largest_layer_params else ())
    return ModelShape(trainable=total_params, module_sizes=(largest_layer_params, *[u for u in units if u]))


def _plans(shape: ModelShape, stage: int, world: int) -> Iterator[tuple[str, str, MemoryPlan]]:
    options = (("cpu", "cpu"), ("cpu", "none"), ("none", "none")) if stage == 3 else (("cpu", "none"), ("none", "none"))
    for optimizer, params in options:
        zero = {"stage": stage, "offload_optimizer": {"device": optimizer}}
        if stage == 3:
            zero["offload_param"] = {"device": params}
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero}
        yield optimizer, params, plan(shape, config, world)


def _print(shape: ModelShape, stage: int, gpus: int, nodes: int, factor: float, largest: int | None) -> None:
    print("Estimated memory needed for params, optim states and gradients (shardwise's planner) for a:\n"
          f"HW: Setup with {nodes} node{'s' if nodes > 1 else ''}, {gpus} GPU{'s' if gpus > 1 else ''} per node.\n"
          f"SW: Model with {int(shape.total / 1e6)}M total params"
          + (f", {int(largest / 1e6)}M largest layer params." if largest is not None else "."))
    print("  per CPU  |  per GPU |   Options")
    for optimizer, params, memory in _plans(shape, stage, gpus * nodes):
        for zero_init in ((True, False) if stage == 3 else (False,)):
            host = memory.peak_host * gpus * factor
            if not zero_init:  # every process loads the whole fp32 model before partitioning
                host = max(host, 4 * shape.total * gpus * factor)
            option = f"offload_param={params:4}, " if stage == 3 else ""
            option += f"offload_optimizer={optimizer:4}" + (f", zero_init={int(zero_init)}" if stage == 3 else "")
            print(f" {host / 2**30:7.2f}GB | {memory.peak_device / 2**30:6.2f}GB | {option}")


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    shape = ModelShape(trainable=total_params, module_sizes=(total_params,))
    _print(shape, 2, num_gpus_per_node, num_nodes, additional_buffer_factor, None)


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    _print(ModelShape.of(model), 2, num_gpus_per_node, num_nodes, additional_buffer_factor, None)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    _print(_cold_shape(total_params, largest_layer_params), 3, num_gpus_per_node, num_nodes,
           additional_buffer_factor, largest_layer_params)


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    shape = ModelShape.of(model)
    _print(shape, 3, num_gpus_per_node, num_nodes, additional_buffer_factor, max(shape.module_sizes, default=0))
