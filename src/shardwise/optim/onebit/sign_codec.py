"""1-bit sign compression with one fp32 scale per block (pure torch, no process group).

A block of `block` values becomes its signs, packed 8 to a byte, and one scale: the mean of the block's
absolute values. Of all single scales that one leaves the smallest squared error, so error feedback (what is
left over is added to the next message) has the least to carry. A zero counts as positive: 1 bit cannot
say zero, which is why an exactly-zero momentum must be masked by the caller, as DeepSpeed notes too.

[Note: sign row layout] One compressed run of n values (n a multiple of `block`, and `block` of 8) is a
flat uint8 row: `[signs: n/8 bytes, element 8i+j in bit j of byte i][scales: n/block fp32, as bytes]`.
A non-finite block gets a non-finite scale, so an overflow survives compression.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SignCodec"]

_SHIFTS = torch.arange(8, dtype=torch.uint8)


@dataclass(frozen=True)
class SignCodec:
    block: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block <= 0 or self.block % 8:
            raise ValueError(f"block: a positive multiple of 8 values per scale is required; got {self.block!r}.")

    def row_bytes(self, numel: int) -> int:
        """Bytes of one compressed row of `numel` values (a multiple of `block`)."""
        return numel // 8 + numel // self.block * 4

    def compress_rows(self, values: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """Compress each row of the fp32 (rows, n) `values` into the uint8 (rows, row_bytes(n)) `out`; with
        `residual`, write there what the compression lost (values - decompressed), which may be `values`."""
        rows, n = values.shape
        blocks = values.view(rows, n // self.block, self.block)
        scales = blocks.abs().mean(dim=2)
        positive = blocks >= 0
        signs = n // 8
        shifts = _SHIFTS.to(values.device)
        out[:, :signs] = (positive.view(rows, signs, 8).to(torch.uint8) << shifts).sum(dim=2, dtype=torch.uint8)
        out[:, signs:] = scales.view(torch.uint8)
        if residual is not None:
            lost = torch.where(positive, scales.unsqueeze(2), -scales.unsqueeze(2))
            torch.sub(blocks, lost, out=residual.view(rows, n // self.block, self.block))

    def decompress_rows(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """The fp32 (rows, n) values of the uint8 (rows, row_bytes(n)) `packed`."""
        rows, signs = packed.shape[0], n // 8
        shifts = _SHIFTS.to(packed.device)
        bits = (packed[:, :signs].unsqueeze(2) >> shifts) & 1
        scales = packed[:, signs:].contiguous().view(torch.float32).view(rows, n // self.block, 1)
        sign = bits.view(rows, n // self.block, self.block).to(torch.float32).mul_(2).sub_(1)
        return sign.mul_(scales).view(rows, n)
