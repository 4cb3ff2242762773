"""The sharding-strategy protocol: one for ZeRO stages 0-3 (implemented in `zero/`, chosen once by
`zero.factory.make_strategy`).

The engine, the checkpoint package and the instruments talk only to this interface: they never branch on
the stage and never probe a strategy for attributes. A strategy owns the module's parameters as training
sees them, the gradient reduction, the master weights and the optimizer over them, and where its state
lives (offload).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from ..config import ZeroConfig
from ..config.sections import AioConfig
from ..distributed import Collectives, Group
from ..distributed.topology import DataSplit
from ..precision import PrecisionPolicy

ParamGroups = list[dict[str, Any]]
"""torch.optim-style parameter groups over the module's parameters."""

MakeOptimizer = Callable[[ParamGroups], torch.optim.Optimizer]
"""Builds (or re-points) the optimizer over the strategy's master parameters."""


@dataclass(frozen=True)
class StateSlot:
    """A piece of one parameter's training state that this rank holds: elements [start, end) of the
    flattened parameter. Checkpoints are written and read as slots, by parameter name, so a
    checkpoint saved under one layout (world size, stage) loads under any other.

    `values` is the fp32 master slice of a trainable parameter, or the stored slice of a frozen one;
    writing into it (then calling `after_state_load`) loads it. The optimizer state of a trainable
    slot is `optimizer.state[opt_param][key].view(-1)[opt_offset : opt_offset + end - start]`.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    values: torch.Tensor
    trainable: bool
    opt_param: torch.Tensor | None = None
    opt_offset: int = 0
    replica: int = 0
    """Which copy of this piece the rank holds where several hold the same one (each data-parallel rank at
    stages 0-2; each node for node-local frozen weights at stage 3): only copy 0 is written or counted."""


@dataclass(frozen=True)
class ModelStateTensors:
    """The model-state tensors a rank holds, by kind, for the memory account (`profiling/memory.py`).
    Views of one storage may appear more than once: the account counts each storage once."""

    params: list[torch.Tensor]
    """The trainable parameters as this rank stores them (stage 3: its slices, and full copies kept resident)."""
    frozen: list[torch.Tensor]
    """The parameters that do not train, as this rank stores them."""
    grads: list[torch.Tensor]
    """Persistent gradient storage (the reduce buckets, or this rank's partition of them)."""
    masters: list[torch.Tensor]
    """What the optimizer updates: fp32 master copies, or the parameters themselves when they are fp32."""
    optimizer_offloaded: bool
    """Masters and optimizer state live in host memory or on disk (offload_optimizer)."""
    params_offloaded: bool
    """Stage-3 parameter slices live in host memory or on disk (offload_param)."""


class ShardingStrategy(Protocol):
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    reduces_every_micro_step: bool
    """True when gradients must be reduced during every backward (stage 2 keeps only partitions), so
    there is no local accumulation that `no_sync` could defer."""
    swaps_to_disk: bool
    """`resident()` reads state in from swap files (NVMe offload) into buffers that are released when it
    exits: a checkpoint snapshot taken inside must copy what it keeps."""

    def begin_backward(self, reduce: bool) -> None:
        """Before a micro-step's backward; `reduce` is true when it ends an accumulation window."""

    def finish_backward(self) -> None:
        """After backward: every gradient is reduced (when `reduce` was set) and ready to step."""

    def loose_param_grads(self) -> int:
        """How many trainable parameters hold a gradient in `param.grad`: gradients only arrive there from a
        backward outside `begin_backward` ... `finish_backward` (zero/grad_buckets.py, [Note: whose gradient
        is it])."""

    def adopt_param_grads(self, scale: float) -> int:
        """Take those gradients (times `scale`) into this strategy's gradients and clear `param.grad`; how
        many. The next `begin_backward` ... `finish_backward` reduces them with the rest."""

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the (loss-scaled) gradients, identical on every rank."""

    def scale_grads(self, factor: float) -> None: ...

    def optimizer_step(self) -> None:
        """Update the master weights and write them into this rank's part of the module's parameters."""

    def sync_params(self) -> None:
        """Make every rank's module parameters current (ZeRO-1/2 all-gather the updated slices)."""

    def zero_grads(self) -> None: ...

    def explain_forward_error(self, error: BaseException) -> str | None:
        """`error` (raised by the module's forward) with what this strategy knows about its cause, or None."""

    def consolidated_state_dict(self, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
        """Whole module weights in the training dtype on global rank 0, None on the other ranks; keys as in
        `module.state_dict()`. A collective where parameters are partitioned: every rank calls it."""

    def load_module_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full module weights (by name) and refresh the master weights from them."""

    def state_slots(self) -> list[StateSlot]:
        """The parameter state this rank holds, by parameter name (see `StateSlot`)."""

    def after_state_load(self) -> None:
        """Make the module's parameters current after `state_slots()` values were overwritten."""

    def resident(self) -> contextlib.AbstractContextManager:
        """Offloaded state in memory for the duration: `state_slots()` is used inside it."""

    def model_state_tensors(self) -> ModelStateTensors:
        """What this rank holds of parameters, gradients, masters (see `ModelStateTensors`)."""

    def close(self) -> None:
        """Release what lives outside memory (swap files); the strategy is not used afterwards."""

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """State that is this rank's alone and outside `state_slots()` (the compression errors of the 1-bit
        optimizers), by name: each rank's checkpoint file keeps its own."""

    def load_rank_local_state(self, own: dict[str, torch.Tensor] | None, first: dict[str, torch.Tensor]) -> list[str]:
        """Restore `rank_local_state()`: `own` is what this rank saved when the layout (world size and topology)
        is unchanged, else None; `first` is `own` when given, else rank 0's. Returns what could not be restored,
        for the warning."""


class NoRankLocalState:
    """The `rank_local_state` half of `ShardingStrategy` for strategies whose optimizer state is all in slots."""

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_rank_local_state(self, own: dict[str, torch.Tensor] | None, first: dict[str, torch.Tensor]) -> list[str]:
        return []


@dataclass(frozen=True)
class StrategyInputs:
    module: torch.nn.Module
    param_groups: ParamGroups
    make_optimizer: MakeOptimizer
    precision: PrecisionPolicy
    dp_group: Group
    comm: Collectives
    zero: ZeroConfig
    prescale_gradients: bool
    gradient_predivide_factor: float
    aio: AioConfig = AioConfig()
    counts_in_norm: Callable[[torch.nn.Parameter], bool] | None = None
    """Whether a parameter's gradient counts in this rank's share of the norm (None: every one). Tensor
    parallelism counts a replicated parameter on one tensor-parallel rank only."""
    node_split: DataSplit | None = None
    """Stage 3: the data group's ranks on this rank's node where the group spans nodes; None on one node."""
    hpz_split: DataSplit | None = None
    """Stage 3: ZeRO++'s secondary partition group (`zero_hpz_partition_size` > 1), else None."""
    compressed_optimizer: bool = False
    """The config's optimizer exchanges compressed momentum itself (OneBitAdam, ZeroOneAdam, OneBitLamb)."""
