"""The loader adapter: each batch a rank's loader yields is cut along the sequence and processed by the whole
sequence-parallel group, one rank's batch after another (DeepSpeed's `UlyssesSPDataLoaderAdapter` behaviour).

At each refill every rank reads one batch from its own loader; the group gathers them, and the next `size`
iterations give every rank its slice of batch 0, then of batch 1, ... So `size` iterations of the adapter do
what one iteration of plain data parallelism does, and `len()` is the loader's times `size`.

Labels become `shift_labels` (the label of the next token, `-100` after the last) before the cut, because the
next token of a slice's last token lives on the next rank; the model computes its loss from them (transformers'
causal-LM loss accepts `shift_labels`), and `combine_loss` weighs each rank's mean by its unmasked tokens.
Position ids are required: each slice must carry its global positions (RoPE, packed-sequence boundaries); a
model left to number its tokens would number each slice from 0.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from .link import SequenceLink, SequenceParallelError

IGNORE_INDEX = -100


class SequenceShardLoader:
    """`loader` (yielding dicts of `[batch, seq, ...]` tensors with `input_ids` and `position_ids`) cut along the
    sequence over `link`'s ranks. `device`: where the gather runs (the accelerator, for NCCL); slices come back on
    the device the loader gave them on."""

    def __init__(self, loader: Any, link: SequenceLink, device: torch.device | str | None = None):
        self.loader, self.link = loader, link
        self.device = torch.device(device) if device is not None else None

    def __len__(self) -> int:
        return len(self.loader) * self.link.size

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, set_epoch, batch_size: the wrapped loader's
        if name in ("loader", "link", "device"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield from self.shard(batch)

    def shard(self, batch: Any) -> list[dict[str, Any]]:
        """This rank's slice of every group member's `batch`, in rank order."""
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise SequenceParallelError(
                f"sequence parallelism: each batch must be a dict with input_ids (and position_ids, labels); got "
                f"{type(batch).__name__}. Return a dict from the collate function.")
        if "position_ids" not in batch:
            raise SequenceParallelError(
                "sequence parallelism: each batch needs position_ids, so that every slice of the sequence keeps its "
                "global positions (without them each rank would number its slice from 0). Add "
                "position_ids = torch.arange(seq_len) per sample in the collate function (for packed sequences, "
                "restart them at each document).")
        shape = _shape_of(batch)
        shapes = [tuple(int(v) for v in s) for s in self.link.all_gather(torch.tensor(shape, device=self._gather_device(batch)))]
        if len({s[0] for s in shapes}) > 1:
            raise SequenceParallelError(
                f"sequence parallelism: the sequence-parallel ranks' batches hold {[s[0] for s in shapes]} samples; "
                "they must hold the same number. Set drop_last=True on the loader (dataloader_drop_last).")
        gathered = {key: self._gather(value) for key, value in batch.items()}
        return [self._slice({key: parts[source] for key, parts in gathered.items()}) for source in range(self.link.size)]

    def _gather_device(self, batch: Mapping[str, Any]) -> torch.device:
        return self.device or batch["input_ids"].device

    def _gather(self, value: Any) -> list[Any]:
        if not torch.is_tensor(value):
            parts: list[Any] = [None] * self.link.size
            dist.all_gather_object(parts, value, group=self.link.group.pg)
            return parts
        home = value.device
        parts = self.link.all_gather_rows(value.to(self.device or home))
        return [p.to(home) for p in parts]

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        length = batch["input_ids"].shape[1]
        size, rank = self.link.size, self.link.rank
        if length % size:
            raise SequenceParallelError(
                f"sequence parallelism: a sequence of {length} tokens cannot be cut into {size} equal slices; pad "
                f"every batch to a multiple of {size} (pad_to_multiple_of={size} in the collator).")
        for key, value in batch.items():
            if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != length):
                raise SequenceParallelError(
                    f"sequence parallelism: {key} has shape {tuple(value.shape)}; every tensor of the batch must be "
                    f"[batch, {length}, ...] like input_ids, to be cut along the sequence.")
        _refuse_left_padding(batch.get("attention_mask"))
        if "labels" in batch:
            labels = batch.pop("labels")
            batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        piece = length // size
        return {key: value[:, rank * piece : (rank + 1) * piece].contiguous() if torch.is_tensor(value) else value
                for key, value in batch.items()}


def _shape_of(batch: Mapping[str, Any]) -> tuple[int, int]:
    ids = batch["input_ids"]
    if not torch.is_tensor(ids) or ids.dim() < 2:
        raise SequenceParallelError(f"sequence parallelism: input_ids must be a [batch, seq] tensor; got "
                                    f"{getattr(ids, 'shape', type(ids).__name__)}.")
    return ids.shape[0], ids.shape[1]


def _refuse_left_padding(mask: Any) -> None:
    """Ulysses attention is causal over the gathered sequence and drops the padding mask: padding on the right
    is then harmless (no real token sees it, its labels are ignored), padding before real tokens is not."""
    if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[1] > 1 and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise SequenceParallelError(
            "sequence parallelism: attention_mask has padding before real tokens (left padding or gaps), which "
            "Ulysses attention cannot honour (it drops the mask and attends causally over the whole sequence); pad "
            "on the right (tokenizer.padding_side = \"right\") or pack sequences with position_ids.")
