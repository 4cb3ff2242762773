"""The sequence-parallel group: `size` consecutive ranks hold one sequence between them (DeepSpeed's layout),
and the choke point their exchanges go through.

[Note: one link per process] Hugging Face's path builds the group before `initialize` (accelerate calls
`register_with_transformers`, which needs it for the attention wrapper, then hands the returned mpu to
`initialize`), and the data adapter and `deepspeed.utils.groups` ask for it without an argument. So the group is
built once per process and recorded here; `initialize` adopts it (or builds it from `sequence_parallel_size`)
and rebinds `comm` to the engine's choke point, so the exchanges are counted in the engine's comms log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import Collectives, Group


class SequenceParallelError(ValueError):
    """Sequence parallelism asked for in a way that cannot run, or would run wrong."""


@dataclass
class SequenceLink:
    group: Group
    comm: Collectives
    exchanges: int = 0
    """Attention calls that went through Ulysses (`setup.AttentionWitness` checks that some did)."""

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def all_gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `local` (all the same shape), in rank order; not differentiable."""
        local = local.detach().contiguous()
        flat = torch.empty(self.size * local.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather(flat, local.reshape(-1), self.group).wait()
        return list(flat.view(self.size, *local.shape).unbind(0))

    def all_gather_rows(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `local` [batch, length, ...] whose lengths may differ, in rank order."""
        lengths = [int(n) for n in self.all_gather(torch.tensor([local.shape[1]], device=local.device))]
        longest = max(lengths)
        padded = local.new_zeros((local.shape[0], longest, *local.shape[2:]))
        padded[:, : local.shape[1]] = local
        return [t[:, :n] for t, n in zip(self.all_gather(padded), lengths)]


_recorded: list[tuple[object, SequenceLink]] = []
"""(the world group it was built in, the link): see [Note: one link per process]."""


def sequence_link(size: int, comm: Collectives | None = None, stride: int = 1) -> SequenceLink:
    """This process's sequence-parallel link of `size` ranks, built on first call (a collective over the world:
    every rank calls at the same point); a later call with another layout is refused. `stride`: the distance
    between a group's ranks (the tensor-parallel size: tensor ranks are adjacent, so the sequence ranks that share
    a tensor coordinate are `stride` apart)."""
    current = recorded_link()
    if current is not None:
        if current.size != size or _stride(current) != stride:
            raise SequenceParallelError(
                f"sequence_parallel_size: the sequence-parallel groups were built for {current.size} ranks; got "
                f"{size}. Use one sequence-parallel size per process (the config's sequence_parallel_size, the "
                "mpu's and register_with_transformers' must agree).")
        if comm is not None:
            current.comm = comm
        return current
    if not dist.is_initialized():
        raise SequenceParallelError("sequence parallelism: torch.distributed is not initialised; call "
                                    "shardwise.init_distributed() (deepspeed.init_distributed()) first.")
    world = dist.get_world_size()
    if size < 1 or world % (size * stride):
        raise SequenceParallelError(f"sequence_parallel_size: {size} x {stride} tensor-parallel ranks must divide the "
                                    f"world size ({world}); choose a divisor of the number of processes.")
    blocks = [[base + i * stride for i in range(size)]
              for start in range(0, world, size * stride) for base in range(start, start + stride)]
    pg, _ = dist.new_subgroups_by_enumeration(blocks)
    mine = next(b for b in blocks if dist.get_rank() in b)
    link = SequenceLink(Group("sequence", pg, size, mine.index(dist.get_rank())), comm or Collectives())
    _recorded[:] = [(dist.group.WORLD, link)]
    return link


def _stride(link: SequenceLink) -> int:
    ranks = dist.get_process_group_ranks(link.group.pg)
    return ranks[1] - ranks[0] if len(ranks) > 1 else 1


def recorded_link() -> SequenceLink | None:
    """The link built in this process's current world, if any."""
    if _recorded and dist.is_initialized() and _recorded[0][0] is dist.group.WORLD:
        return _recorded[0][1]
    return None
