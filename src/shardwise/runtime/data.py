"""The distributed data loader: each data-parallel rank reads its own disjoint slice of the dataset.

Deterministic for a seed; `set_epoch` reshuffles. Each epoch follows DistributedSampler's order (shuffled,
micro-batches per rank), so runs are comparable with DeepSpeed's loader. A checkpoint keeps the epoch
position (samples consumed by all ranks together), so a run resumed at another data-parallel size or
micro-batch size reads each remaining sample of the epoch once (see [Note: epoch position] in
`sample_order.py`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .sample_order import batch_count, epoch_order, position_after, rank_share, share_size

logger = logging.getLogger(__name__)


class EpochSampler(Sampler[int]):
    """One rank's indices of an epoch's order, from position `start` on (0: the whole epoch, exactly as
    DistributedSampler(shuffle=True) hands them out)."""

    def __init__(self, dataset_size: int, dp_rank: int, dp_size: int, seed: int, drop_last: bool, shuffle: bool = True):
        self.dataset_size, self.dp_rank, self.dp_size = dataset_size, dp_rank, dp_size
        self.seed, self.drop_last, self.shuffle = seed, drop_last, shuffle
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.dataset_size, self.seed, self.epoch, self.shuffle)
        return iter(rank_share(order, self.start, self.dp_rank, self.dp_size, self.drop_last))

    def __len__(self) -> int:
        return share_size(self.dataset_size - self.start, self.dp_size, self.drop_last)


class DistributedLoader:
    """Micro-batches of this rank's share of each epoch, resumable at any layout from `state_dict()`.
    `shuffle=False` reads every epoch in dataset order (DeepSpeed's pipeline engine does)."""

    def __init__(
        self,
        dataset: Dataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        num_workers: int = 0,
        shuffle: bool = True,
    ):
        self.dataset_size = len(dataset)  # type: ignore[arg-type]
        self.micro_batch_size, self.dp_size, self.drop_last = micro_batch_size, dp_size, drop_last
        self.sampler = EpochSampler(self.dataset_size, dp_rank, dp_size, seed, drop_last, shuffle)
        # Its own generator: the order must not depend on torch's global RNG, or a run resumed mid-epoch (RNG
        # restored, then a new iterator) would see different dropout masks from then on. The one global draw a
        # fresh pass makes is __iter__'s ([Note: one global draw per pass]).
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler, collate_fn=collate_fn,
                                 drop_last=drop_last, num_workers=num_workers,
                                 generator=torch.Generator().manual_seed(seed))
        self.epoch = 0
        self.consumed = 0
        """Samples of the current epoch's order read by all ranks together: where a checkpoint resumes."""
        self._resume_at = 0

    @property
    def seed(self) -> int:
        return self.sampler.seed

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume_at = 0  # a resume position belongs to its own epoch only
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Micro-batches per rank in a whole epoch."""
        return self._batches_from(0)

    def __iter__(self) -> Iterator[Any]:
        start, self._resume_at = self._resume_at, 0
        if start and self._batches_from(start) == 0:
            # A checkpoint taken at the end of an epoch: nothing of it is left to read at this layout, and a
            # pass that yields no batch would let a training loop end having trained nothing. The pass reads
            # the next epoch, as DeepSpeed's fresh loader does.
            logger.info("data_loader: the resumed epoch %d was already read to its end; this pass reads epoch %d.",
                        self.epoch, self.epoch + 1)
            self.set_epoch(self.epoch + 1)
            start = 0
        if start == 0:
            # [Note: one global draw per pass] DeepSpeed's loader is a torch DataLoader without a generator, and
            # each pass over it begins by drawing one number from torch's global RNG: drawing it too keeps dropout
            # and every later draw of the script in step with a DeepSpeed run. A pass resumed mid-epoch draws
            # nothing, because the run it continues drew when that epoch began.
            torch.empty((), dtype=torch.int64).random_()
        self.sampler.start = self.consumed = start
        total = len(self.loader)
        if total == 0:  # a training loop over this pass would end at once, having trained nothing
            logger.warning("data_loader: this pass over epoch %d yields no batch: the dataset's %d samples make less "
                           "than one micro-batch of %d per rank over %d data-parallel ranks%s.", self.epoch,
                           self.dataset_size, self.micro_batch_size, self.dp_size,
                           " with drop_last" if self.drop_last else "")
        for read, batch in enumerate(self.loader, 1):
            self.consumed = position_after(start, read, total, self.micro_batch_size, self.dp_size,
                                           self.dataset_size)
            yield batch
        self.consumed = self.dataset_size

    def _batches_from(self, position: int) -> int:
        """Micro-batches per rank left in the epoch once `position` samples of it are consumed."""
        share = share_size(self.dataset_size - position, self.dp_size, self.drop_last)
        return batch_count(share, self.micro_batch_size, self.drop_last)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "dataset_size": self.dataset_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration continues epoch `epoch` after its first `consumed` samples (all ranks together),
        at this loader's data-parallel size and micro-batch size."""
        warn = logger.warning if self.sampler.dp_rank == 0 else logger.debug  # one copy of rank-independent news
        epoch, consumed = state["epoch"], _consumed(state, self.micro_batch_size, self.dp_size, warn)
        if state.get("seed", self.seed) != self.seed:
            warn("data_loader: the checkpoint's epoch order is seeded with %d, this loader's with %d; the "
                 "checkpoint's seed is kept, so the resumed epoch reads the samples it had left.",
                 state["seed"], self.seed)
            self.sampler.seed = state["seed"]
        saved_size = state.get("dataset_size", self.dataset_size)
        if saved_size != self.dataset_size:
            warn("data_loader: the checkpoint's epoch %d is an order of %d samples, the dataset now has %d, so which "
                 "samples it consumed is unknown; the loader starts epoch %d from its beginning instead.",
                 epoch, saved_size, self.dataset_size, epoch + 1)
            epoch, consumed = epoch + 1, 0
        self.set_epoch(epoch)
        self._resume_at = self.consumed = min(consumed, self.dataset_size)


def _consumed(state: dict[str, int], micro_batch_size: int, dp_size: int, warn: Callable[..., None]) -> int:
    """The epoch position of a loader state; a state saved before positions were recorded counts batches
    per rank, which the saving layout (its keys `micro_batch_size`, `dp_size` when known) turns into one."""
    if "consumed" in state:
        return state["consumed"]
    micro, dp = state.get("micro_batch_size", micro_batch_size), state.get("dp_size", dp_size)
    consumed = state["batches_seen"] * micro * dp
    warn("data_loader: the checkpoint counts batches read per rank (batches_seen=%d, an older format), not "
         "samples consumed; taken as %d × micro-batch %d × %d data-parallel ranks = %d samples of epoch %d, exact "
         "only if the saving run's loader had that layout. Save a new checkpoint to record the position itself.",
         state["batches_seen"], state["batches_seen"], micro, dp, consumed, state["epoch"])
    return consumed


class RepeatingLoader:
    """Wraps a loader so that iteration never ends: it restarts (a new epoch, reshuffled) when exhausted."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.epoch = getattr(loader, "epoch", 0)
        self._it = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            # The loader's own epoch when it has one: a checkpoint loaded after this wrapper was made moves it.
            self.epoch = getattr(self.loader, "epoch", self.epoch) + 1
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(self.epoch)
            self._it = iter(self.loader)
            return next(self._it)


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    return batch
