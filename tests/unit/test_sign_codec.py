"""The 1-bit sign codec (`optim/onebit/sign_codec.py`): the packed row layout, the mean-|x| scale, the
residual that error feedback carries, non-finite blocks, byte counts and refused block sizes."""

from __future__ import annotations

import pytest
import torch

from shardwise.optim.onebit.sign_codec import SignCodec


def _compress(codec: SignCodec, values: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    rows, n = values.shape
    out = torch.full((rows, codec.row_bytes(n)), 0xAB, dtype=torch.uint8)  # garbage to overwrite
    codec.compress_rows(values, out, residual=residual)
    return out


def test_crafted_row_packs_signs_bit_by_bit_and_one_mean_scale_per_block():
    codec = SignCodec(block=8)
    # Block 0: element j of byte 0 is bit j; a zero (and a negative zero) counts as positive.
    # Block 1: all negative. Mean |x|: (1+2+0+0+4+1+3+5)/8 = 2, and 0.5.
    row = torch.tensor([[1.0, -2.0, 0.0, -0.0, 4.0, -1.0, -3.0, 5.0] + [-0.5] * 8])
    packed = _compress(codec, row)
    assert packed.shape == (1, 2 + 2 * 4)
    assert packed[0, 0].item() == 0b1001_1101  # positive at 0, 2, 3, 4, 7
    assert packed[0, 1].item() == 0
    assert packed[0, 2:].clone().view(torch.float32).tolist() == [2.0, 0.5]
    out = codec.decompress_rows(packed, 16)
    assert out.tolist() == [[2.0, -2.0, 2.0, 2.0, 2.0, -2.0, -2.0, 2.0] + [-0.5] * 8]


def test_scale_is_the_blocks_mean_absolute_value_and_the_residual_is_exactly_what_was_lost():
    codec = SignCodec(block=64)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 256, generator=g) * torch.logspace(-3, 3, 256)
    residual = torch.full_like(values, float("nan"))
    packed = _compress(codec, values, residual)
    decoded = codec.decompress_rows(packed, 256)
    scales = values.double().abs().view(3, 4, 64).mean(dim=2)
    torch.testing.assert_close(packed[:, 32:].contiguous().view(torch.float32).double(), scales, rtol=1e-6, atol=0)
    assert torch.equal(decoded.abs().view(3, 4, 64), packed[:, 32:].contiguous().view(torch.float32).view(3, 4, 1)
                       .expand(3, 4, 64))
    assert torch.equal(decoded.sign(), torch.where(values >= 0, 1.0, -1.0))
    assert torch.equal(residual, values - decoded)  # bit for bit: error feedback loses nothing more


def test_residual_may_overwrite_the_values_in_place():
    codec = SignCodec(block=16)
    values = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    expected_packed = _compress(codec, values.clone())
    expected_residual = values - codec.decompress_rows(expected_packed, 64)
    packed = _compress(codec, values, residual=values)
    assert torch.equal(packed, expected_packed)
    assert torch.equal(values, expected_residual)


def test_a_single_row_or_one_sliced_from_a_buffer_decompresses_whatever_the_byte_offset_of_its_scales():
    # Block 8: one row of 8 values is 1 sign byte then the fp32 scale at byte 1 (not a multiple of 4).
    codec = SignCodec(block=8)
    rows = torch.tensor([[1.0, -1.0] * 4, [-2.0, 2.0] * 4, [0.5] * 8])
    packed = _compress(codec, rows)
    for r in range(3):
        assert torch.equal(codec.decompress_rows(packed[r : r + 1], 8), rows[r : r + 1])
        assert torch.equal(codec.decompress_rows(_compress(codec, rows[r : r + 1]), 8), rows[r : r + 1])


def test_rows_are_compressed_independently():
    codec = SignCodec(block=8)
    rows = torch.tensor([[1.0] * 8, [-3.0] * 8])
    decoded = codec.decompress_rows(_compress(codec, rows), 8)
    assert decoded.tolist() == [[1.0] * 8, [-3.0] * 8]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_makes_its_block_non_finite_and_leaves_the_others_alone(bad: float):
    codec = SignCodec(block=8)
    row = torch.arange(1.0, 17.0).view(1, 16)
    row[0, 11] = bad
    decoded = codec.decompress_rows(_compress(codec, row), 16)
    assert not torch.isfinite(decoded[0, 8:]).any()  # an overflow survives compression
    assert torch.equal(decoded[0, :8], torch.full((8,), 4.5))


def test_default_block_and_row_bytes():
    codec = SignCodec()
    assert codec.block == 1024
    assert codec.row_bytes(1024) == 128 + 4
    assert codec.row_bytes(3 * 1024) == 3 * 128 + 3 * 4
    assert SignCodec(block=8).row_bytes(16) == 2 + 8
    values = torch.randn(2, 2048, generator=torch.Generator().manual_seed(2))
    assert _compress(codec, values).shape == (2, codec.row_bytes(2048))  # 1/31 of the fp32 bytes


@pytest.mark.parametrize("block", [0, -8, 12, 1, True, 8.0, "8"])
def test_block_sizes_that_cannot_pack_whole_bytes_are_refused(block):
    with pytest.raises(ValueError, match=r"^block: a positive multiple of 8 values per scale is required; got "
                                         + repr(block).replace(".", r"\.") + r"\.$"):
        SignCodec(block=block)
