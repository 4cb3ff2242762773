"""Block-wise symmetric quantization to int8 or int4 with fp32 scales (pure torch, no process group).

The codec of ZeRO++'s quantized weights and gradients (`quantized_comm.py`). Every `block` consecutive
elements share one fp32 scale, the block's absolute maximum over `qmax` (127 for int8, 7 for int4); an
element becomes round(x / scale), so its error after dequantization is at most scale / 2 (up to fp32
rounding of the division and of code × scale). An all-zero block has scale 0 and comes back as zeros.
A block holding inf or NaN gets a non-finite scale, so the whole block dequantizes to non-finite values:
an overflow still reaches the loss scaler's check instead of being rounded away.

[Note: packed layout] One packed chunk of n elements is a flat uint8 buffer:
`[codes: ceil(n/block) * block * bits/8 bytes][scales: ceil(n/block) fp32, as bytes]`. The last block is
padded with zeros. int8 codes are two's complement bytes; int4 codes are stored as code + 8 (1..15), two to
a byte, the even element in the low nibble. Scales are native-endian fp32; every rank of a job shares the
byte order, which is all a collective needs.

All of it is vectorised over blocks and over rows: `pack_rows` packs a (rows, n) tensor into
(rows, packed_bytes(n)) in one pass, which is how a collective packs one chunk per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockQuant"]

_QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class BlockQuant:
    """Symmetric per-block absmax quantization: `bits` (8 or 4) per element, one fp32 scale per `block`."""

    bits: int
    block: int

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or self.bits not in _QMAX:
            raise ValueError(f"bits: 8 or 4 is required; got {self.bits!r}. Use 8 for weights (qwZ) or 4 for "
                             "gradients (qgZ).")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block <= 0:
            raise ValueError(f"block: a positive number of elements per scale is required; got {self.block!r}. "
                             "Use e.g. 256.")
        if self.bits == 4 and self.block % 2:
            raise ValueError(f"block: an even number is required with 4 bits (two codes per byte); got "
                             f"{self.block}. Use {self.block + 1}.")

    @property
    def qmax(self) -> int:
        """The largest code magnitude: 127 for int8, 7 for int4."""
        return _QMAX[self.bits]

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of one chunk of `numel` elements (the tail block padded)."""
        return self.blocks(numel) * self.block * self.bits // 8

    def packed_bytes(self, numel: int) -> int:
        """Bytes one packed chunk of `numel` elements takes: codes + fp32 scales ([Note: packed layout])."""
        return self.code_bytes(numel) + 4 * self.blocks(numel)

    def pack(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize the 1-D float tensor `values` into the 1-D uint8 `out` of `packed_bytes(len(values))`."""
        self.pack_rows(values.view(1, -1), out.view(1, -1))

    def unpack(self, packed: torch.Tensor, numel: int, out: torch.Tensor) -> None:
        """Dequantize one packed chunk of `numel` elements into the 1-D float tensor `out` (any float dtype)."""
        self.unpack_rows(packed.view(1, -1), numel, out.view(1, -1))

    def pack_rows(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize each row of the (rows, n) float tensor `values` into the matching row of the
        (rows, packed_bytes(n)) uint8 tensor `out`."""
        rows, numel = values.shape
        self._check(out, rows, numel, "out")
        blocks, split = self.blocks(numel), self.code_bytes(numel)
        padded = torch.zeros(rows, blocks * self.block, dtype=torch.float32, device=values.device)
        padded[:, :numel] = values
        padded = padded.view(rows, blocks, self.block)
        scale = padded.abs().amax(dim=2) / self.qmax  # (rows, blocks); NaN-propagating, inf stays inf
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0, scale 0
        codes = padded.div_(divisor.unsqueeze(2)).round_().clamp_(-self.qmax, self.qmax).view(rows, -1)
        if self.bits == 8:
            out[:, :split].view(torch.int8).copy_(codes)
        else:
            nibbles = codes.add_(8).to(torch.uint8)
            out[:, :split].copy_(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
        out[:, split:].copy_(scale.view(torch.uint8))

    def unpack_rows(self, packed: torch.Tensor, numel: int, out: torch.Tensor) -> None:
        """Dequantize each row of the (rows, packed_bytes(numel)) uint8 `packed` into the matching row of
        the (rows, numel) float tensor `out`."""
        rows = packed.shape[0]
        self._check(packed, rows, numel, "packed")
        if tuple(out.shape) != (rows, numel):
            raise ValueError(f"out: shape ({rows}, {numel}) is required; got {tuple(out.shape)}.")
        blocks, split = self.blocks(numel), self.code_bytes(numel)
        # A copy of the scale bytes: a uint8 slice at an offset that is not a multiple of 4 cannot be viewed
        # as fp32 in place, and the scales are 4/block of the data.
        scale = packed[:, split:].clone(memory_format=torch.contiguous_format).view(torch.float32)
        if self.bits == 8:
            codes = packed[:, :split].view(torch.int8).to(torch.float32)
        else:
            low = (packed[:, :split] & 0xF).to(torch.float32)
            high = (packed[:, :split] >> 4).to(torch.float32)
            codes = torch.stack([low, high], dim=2).view(rows, -1).sub_(8)
        values = codes.view(rows, blocks, self.block).mul_(scale.unsqueeze(2)).view(rows, -1)
        out.copy_(values[:, :numel])

    def _check(self, packed: torch.Tensor, rows: int, numel: int, name: str) -> None:
        expected = (rows, self.packed_bytes(numel))
        if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
            raise ValueError(f"{name}: a uint8 tensor of shape {expected} (packed_bytes({numel}) per row) is "
                             f"required; got {str(packed.dtype).removeprefix('torch.')} {tuple(packed.shape)}.")
