"""Block quantization (`zero/quantize.py`): the error bound, the packed layout, tails, zeros, dtypes, errors."""

from __future__ import annotations

import pytest
import torch

from shardwise.zero.quantize import BlockQuant

# fp32 rounding of x / scale and of code * scale: a few ulps of the block's absmax (= qmax * scale).
SLACK = 2e-5


def _round_trip(quant: BlockQuant, values: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    packed = torch.full((quant.packed_bytes(values.numel()),), 0xAB, dtype=torch.uint8)  # garbage to overwrite
    quant.pack(values, packed)
    out = torch.empty(values.numel(), dtype=out_dtype)
    quant.unpack(packed, values.numel(), out)
    return out


def _scales(quant: BlockQuant, values: torch.Tensor) -> torch.Tensor:
    """Each element's block scale (absmax / qmax), computed independently of the codec."""
    x = values.double()
    blocks = [x[i : i + quant.block].abs().max().expand(min(quant.block, x.numel() - i))
              for i in range(0, x.numel(), quant.block)]
    return torch.cat(blocks) / quant.qmax


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 37, 256, 1001])
def test_error_is_at_most_half_a_scale(bits: int, numel: int):
    quant = BlockQuant(bits, 64)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-3, 2, numel)
    error = (_round_trip(quant, values).double() - values.double()).abs()
    bound = _scales(quant, values) * (0.5 + SLACK)
    assert (error <= bound).all(), f"worst excess {(error - bound).max()}"
    if numel > 1:  # it did quantize: a codec that copies the floats would pass the bound trivially
        assert error.max() > 0


def test_negative_values_and_length_below_a_block():
    quant = BlockQuant(8, 256)
    values = -torch.linspace(0.1, 3.0, 11)
    out = _round_trip(quant, values)
    assert (out < 0).all()
    assert ((out - values).abs() <= values.abs().max() / 127 * (0.5 + SLACK)).all()
    assert quant.packed_bytes(11) == 256 + 4  # one block of codes, padded, and one fp32 scale


@pytest.mark.parametrize("bits", [8, 4])
def test_exactly_representable_values_come_back_exactly(bits: int):
    quant, block = BlockQuant(bits, 8), 8
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(-quant.qmax, quant.qmax + 1, (4, block), generator=gen).float()
    codes[:, 0] = torch.tensor([quant.qmax, -quant.qmax, quant.qmax, -quant.qmax])  # absmax / qmax = the scale
    scales = torch.tensor([0.25, 2.0, 1 / 64, 8.0])  # powers of two: code * scale and absmax / qmax are exact
    values = (codes * scales[:, None]).reshape(-1)
    assert torch.equal(_round_trip(quant, values), values)


def test_int8_layout_is_codes_then_fp32_scales():
    quant = BlockQuant(8, 4)
    values = torch.tensor([127.0, -1, 0, 5, 2.5, 0, 0, 0, -0.5])  # scales 1, 2.5/127, 0.5/127
    packed = torch.empty(quant.packed_bytes(9), dtype=torch.uint8)
    quant.pack(values, packed)
    assert packed.numel() == 12 + 3 * 4
    assert packed[:12].view(torch.int8).tolist() == [127, -1, 0, 5, 127, 0, 0, 0, -127, 0, 0, 0]
    assert torch.equal(packed[12:].clone().view(torch.float32), torch.tensor([127.0, 2.5, 0.5]) / 127)


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    quant = BlockQuant(4, 4)
    values = torch.tensor([7.0, -7, 1, 0, -7])  # scale 1 for both blocks; stored as code + 8: -7 -> 1, 7 -> 15
    packed = torch.empty(quant.packed_bytes(5), dtype=torch.uint8)
    quant.pack(values, packed)
    assert quant.packed_bytes(5) == 2 * 2 + 2 * 4
    assert packed[:4].tolist() == [15 | (1 << 4), 9 | (8 << 4), 1 | (8 << 4), 8 | (8 << 4)]
    assert torch.equal(_round_trip(quant, values), values)


def test_all_zero_block_gives_zeros_not_nan():
    quant = BlockQuant(4, 16)
    values = torch.cat([torch.zeros(16), torch.randn(16), torch.zeros(5)])
    out = _round_trip(quant, values)
    assert torch.equal(out[:16], torch.zeros(16)) and torch.equal(out[32:], torch.zeros(5))
    assert torch.isfinite(out).all()


def test_non_finite_input_poisons_its_block_so_overflow_stays_visible():
    quant = BlockQuant(8, 4)
    values = torch.tensor([1.0, float("inf"), 2, 3, 1, 2, 3, 4, float("nan"), 0, 0, 0])
    out = _round_trip(quant, values)
    assert not torch.isfinite(out[:4]).any() and not torch.isfinite(out[8:]).any()
    assert torch.isfinite(out[4:8]).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bf16_input(out_dtype: torch.dtype):
    quant = BlockQuant(8, 32)
    values = torch.randn(77, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = _round_trip(quant, values, out_dtype)
    assert out.dtype == out_dtype
    reference = _round_trip(quant, values.float())  # the codec sees the same numbers, widened
    assert torch.equal(out, reference.to(out_dtype))
    assert ((reference.double() - values.double()).abs() <= _scales(quant, values.float()) * (0.5 + SLACK)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_pack_like_one_chunk_each(bits: int):
    quant, rows, numel = BlockQuant(bits, 16), 3, 45
    values = torch.randn(rows, numel, generator=torch.Generator().manual_seed(1))
    packed = torch.empty(rows, quant.packed_bytes(numel), dtype=torch.uint8)
    quant.pack_rows(values, packed)
    out = torch.empty(rows, numel)
    quant.unpack_rows(packed, numel, out)
    for r in range(rows):
        one = torch.empty(quant.packed_bytes(numel), dtype=torch.uint8)
        quant.pack(values[r], one)
        assert torch.equal(packed[r], one)
        assert torch.equal(out[r], _round_trip(quant, values[r]))


def test_unaligned_chunk_of_a_larger_buffer():
    """A chunk at an odd byte offset (a rank's chunk of a gathered buffer) unpacks like an aligned one."""
    quant = BlockQuant(4, 6)  # 3 code bytes + 4 scale bytes per block: 7-byte chunks
    values = torch.randn(6)
    buffer = torch.empty(1 + quant.packed_bytes(6), dtype=torch.uint8)
    quant.pack(values, buffer[1:])
    out = torch.empty(6)
    quant.unpack(buffer[1:], 6, out)
    assert torch.equal(out, _round_trip(quant, values))


@pytest.mark.parametrize("bits, block, message", [
    (3, 256, "bits: 8 or 4 is required; got 3."),
    (8.0, 256, "bits: 8 or 4 is required; got 8.0."),
    (8, 0, "block: a positive number of elements per scale is required; got 0."),
    (4, 255, "block: an even number is required with 4 bits (two codes per byte); got 255. Use 256."),
])
def test_bad_settings_are_refused(bits, block, message: str):
    with pytest.raises(ValueError) as info:
        BlockQuant(bits, block)
    assert message in str(info.value)


def test_wrong_buffer_size_is_refused():
    quant = BlockQuant(8, 256)
    with pytest.raises(ValueError, match=r"out: a uint8 tensor of shape \(1, 260\)"):
        quant.pack(torch.randn(10), torch.empty(259, dtype=torch.uint8))
