"""What the checkpoint package, the parameter-access helpers and the engine's watchers (the out-of-memory
explainer, the plan probe) need of a training engine (`runtime.Engine` implements it): they are called with the
engine but must not import the engine's module, which imports them."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..config import Config
from ..distributed import Topology
from ..precision import PrecisionPolicy
from .tensor_shard import TensorShard
from .strategy import ShardingStrategy


class BackgroundSaver(Protocol):
    def save(self, engine: TrainingEngine, save_dir: str, tag: str | None, client_state: dict[str, Any],
             save_latest: bool, exclude_frozen: bool = False) -> str:
        """Save now, or start a background save (`checkpoint.async_save`); the checkpoint's directory."""

    def wait(self) -> None:
        """Until a background save has finished (raising what it failed with)."""


class TrainingEngine(Protocol):
    module: torch.nn.Module
    strategy: ShardingStrategy
    config: Config
    topology: Topology
    precision: PrecisionPolicy
    lr_scheduler: Any
    """A torch LR scheduler, shardwise's own (optim/schedulers.py) or None."""
    training_dataloader: Any
    """The loader `initialize(training_data=...)` built, or None."""
    checkpoint_writer: BackgroundSaver
    tensor_shards: dict[str, TensorShard]
    """Each tensor-parallel split parameter's place in the whole one, by name (empty without tensor parallelism)."""
    global_steps: int
    global_samples: int
    micro_steps: int
    window_micro_steps: int
    device: torch.device
    global_rank: int
    instruments: Any
    """The engine's `profiling.Instruments` (timers, memory and activation trackers); typed loosely so that this
    leaf need not import profiling."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def train_batch_size(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...

    def memory_breakdown(self) -> Any:
        """This rank's memory by part now (`profiling.memory.MemoryBreakdown`)."""
