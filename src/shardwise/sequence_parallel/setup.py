"""How `initialize` decides the sequence-parallel size and switches the model to Ulysses attention.

The size comes from the config's `sequence_parallel_size` or from an mpu that has sequence-parallel groups
(DeepSpeed's `parallel_state_sp`, which accelerate passes); those given must agree. The sequence ranks sit inside
the data-parallel group: gradients are averaged, and ZeRO partitions, over all of them, while the batch is
counted per sequence group (`train_batch_size` = micro × accumulation × world / size).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

from torch import nn

from ..config import ConfigError
from ..distributed import Collectives
from ..profiling.noop import NOTHING
from .hf import attention_implementation, is_registered, register_with_transformers
from .link import SequenceLink, SequenceParallelError, sequence_link


def is_sequence_mpu(mpu: Any) -> bool:
    """An mpu of sequence-parallel groups (its "model-parallel" getters are aliases of the sequence ones)."""
    return mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size")


def sequence_parallel_size(raw: dict[str, Any], mpu: Any) -> int:
    sources = {"sequence_parallel_size": raw.get("sequence_parallel_size", 1)}
    if is_sequence_mpu(mpu):
        sources["the mpu's get_sequence_parallel_world_size()"] = int(mpu.get_sequence_parallel_world_size())
    sizes = {k: v for k, v in sources.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    if len(set(sizes.values())) > 1:
        raise ConfigError([f"sequence_parallel_size: the sequence-parallel sizes given differ ({sizes}); give one size."])
    return next(iter(sizes.values()), 1)


def check_companions(config: Any, size: int) -> None:
    """Refuse what cuts or reshapes the sequence on each rank as if it held the whole of it."""
    if size == 1:
        return
    clashes = {
        "data_efficiency.data_routing.random_ltd": config.data_efficiency.random_ltd is not None,
        "curriculum_learning (its seqlen cut)": config.curriculum_learning is not None,
        "sparse_attention": config.sparse_attention is not None,
        "tensor_parallel.sequence_parallel (Megatron's split of norms and residuals)":
            config.tensor_parallel.sequence_parallel,
    }
    named = [name for name, on in clashes.items() if on]
    if named:
        raise ConfigError([f"sequence_parallel_size: Ulysses ({size}) gives each rank a slice of the sequence, which "
                           f"{', '.join(named)} would treat as the whole sequence; turn one of them off."])


def replicas(data: int, sequence: int) -> int:
    """Model replicas that each take a batch: the data-parallel ranks less the sequence split."""
    if data % sequence:
        raise ConfigError([f"sequence_parallel_size: {sequence} must divide the data-parallel size ({data}); choose a "
                           "divisor of the number of processes (less pipeline and tensor parallelism)."])
    return data // sequence


def setup_sequence_parallel(model: nn.Module, size: int, pipe: int, tensor: int, comm: Collectives) -> SequenceLink | None:
    """The link (its traffic through `comm`), with a transformers model's attention switched; None for size 1.
    Beside tensor parallelism, each tensor rank's heads (already 1/tensor of them) are split again over the
    sequence ranks that share its tensor coordinate."""
    if size == 1:
        return None
    if pipe > 1:
        raise ConfigError([f"sequence_parallel_size: sequence parallelism with pipeline parallelism is not supported "
                           f"yet; got {size} with {pipe} stages. Use it with data and tensor parallelism and ZeRO."])
    link = sequence_link(size, comm, stride=tensor)
    if hasattr(getattr(model, "config", None), "_attn_implementation"):  # a transformers model (or PEFT's wrapper)
        if not is_registered(attention_implementation(model)):
            register_with_transformers(model, link, tensor=tensor)
    return link


class AttentionWitness:
    """Refuses a training forward in which no attention went through Ulysses: each rank would then attend over
    its own slice only and train on a wrong loss without a word. Checked until it has seen one."""

    def __init__(self, link: SequenceLink):
        self.link, self.seen = link, False

    def __call__(self, training: bool) -> ContextManager[None]:
        return NOTHING if self.seen or not training else self._watch()

    @contextlib.contextmanager
    def _watch(self) -> Iterator[None]:
        before = self.link.exchanges
        yield
        if self.link.exchanges == before:
            raise SequenceParallelError(
                f"sequence_parallel_size: {self.link.size}, but no attention of the model went through Ulysses in "
                "this forward, so each rank attended over its own slice only. Use a transformers model (its attention "
                "is switched at initialize), or call shardwise.sequence_parallel.UlyssesAttention in your attention.")
        self.seen = True
