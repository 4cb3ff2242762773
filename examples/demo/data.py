"""Next-token windows over a text file, for the demo and the benchmarks.

The whole file is tokenized once; the last `val_fraction` of the token stream is the validation split, so the
two splits never share a token. Window i starts at `i * stride` and holds `seq_len + 1` tokens: the first
`seq_len` are the inputs, the last `seq_len` the labels. Nothing here is random; shuffling is the sampler's job.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from .tokenizer import ByteTokenizer

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "kjv_genesis_to_2samuel.txt"


class TextDataset(Dataset):
    """`(input_ids, labels)` pairs of `seq_len` int64 tokens each; labels are the inputs shifted by one."""

    def __init__(
        self,
        path: str | Path = DEFAULT_TEXT,
        seq_len: int = 128,
        split: str = "train",
        val_fraction: float = 0.05,
        stride: int | None = None,
    ) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split: must be 'train' or 'val'; got {split!r}.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction: must be in (0, 1); got {val_fraction}.")
        self.seq_len = seq_len
        self.stride = seq_len if stride is None else stride
        if seq_len < 1 or self.stride < 1:
            raise ValueError(f"seq_len and stride: must be >= 1; got {seq_len} and {self.stride}.")
        text = Path(path).read_text(encoding="utf-8")
        # Byte ids fit in uint8: 1/8 of the memory of int64; windows are widened on the way out.
        tokens_all = torch.tensor(ByteTokenizer().encode(text), dtype=torch.uint8)
        split_at = int(len(tokens_all) * (1.0 - val_fraction))
        self.start = 0 if split == "train" else split_at  # offset of this split in the whole token stream
        self.tokens = tokens_all[:split_at] if split == "train" else tokens_all[split_at:]
        if len(self.tokens) < seq_len + 1:
            raise ValueError(
                f"seq_len: the {split} split has {len(self.tokens)} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}. Use a shorter seq_len or a longer text."
            )

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        begin = (index % len(self)) * self.stride
        window = self.tokens[begin : begin + self.seq_len + 1].long()
        return window[:-1], window[1:]
