"""The distributed data loader: each data-parallel rank reads its own disjoint slice of the dataset.

Deterministic for a seed; `set_epoch` reshuffles. This is DeepSpeed's loader behaviour (a
DistributedSampler with shuffling, micro-batches per rank), so runs are comparable between the two.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DistributedLoader:
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
    ):
        self.sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed,
                                          drop_last=drop_last)
        # Its own generator: starting an epoch must not draw from torch's global RNG, or a run resumed
        # mid-epoch (RNG restored, then a new iterator) would see different dropout masks from then on.
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler, collate_fn=collate_fn,
                                 drop_last=drop_last, num_workers=num_workers,
                                 generator=torch.Generator().manual_seed(seed))
        self.epoch = 0
        self.batches_seen = 0
        """Batches handed out in the current epoch: the position a checkpoint resumes from."""
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        self.batches_seen = skip
        iterator = iter(self.loader)
        if skip:
            # Resume mid-epoch without loading the skipped samples: restart the batch sampler past them.
            sampler_iter = iter(self.loader.batch_sampler)
            for _ in range(skip):
                next(sampler_iter, None)
            iterator = (self.loader.collate_fn([self.loader.dataset[i] for i in batch]) for batch in sampler_iter)
        for batch in iterator:
            self.batches_seen += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration continues epoch `epoch` after its first `batches_seen` batches."""
        self.set_epoch(state["epoch"])
        self._skip = state["batches_seen"]


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
            self.epoch += 1
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
