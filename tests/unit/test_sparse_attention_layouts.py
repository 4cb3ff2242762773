"""Sparsity layouts (shardwise.sparse_attention.layouts) against hand-drawn expectations on 8 blocks
(block 2, 16 tokens), their invariants, and the argument errors a user sees."""

from __future__ import annotations

import pytest
import torch

from shardwise.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                        FixedSparsityConfig, LocalSlidingWindowSparsityConfig, SparsityConfigError,
                                        VariableSparsityConfig)


def drawn(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row.replace(" ", "")] for row in rows], dtype=torch.int64)


CASES = {
    "dense": (DenseSparsityConfig(2, block=2), drawn(*["11111111"] * 8)),
    "fixed bidirectional": (FixedSparsityConfig(2, block=2), drawn(
        "1111 0001", "1111 0001", "1111 0001", "1111 0001",
        "0001 1111", "0001 1111", "0001 1111", "0001 1111")),
    "fixed unidirectional": (FixedSparsityConfig(2, block=2, attention="unidirectional"), drawn(
        "1000 0000", "1100 0000", "1110 0000", "1111 0000",
        "0001 1000", "0001 1100", "0001 1110", "0001 1111")),
    "fixed horizontal": (FixedSparsityConfig(2, block=2, num_local_blocks=2, horizontal_global_attention=True), drawn(
        "11 01 01 01", "11 11 11 11", "01 11 01 01", "11 11 11 11",
        "01 01 11 01", "11 11 11 11", "01 01 01 11", "11 11 11 11")),
    "variable": (VariableSparsityConfig(2, block=2, local_window_blocks=[1, 2], horizontal_global_attention=True), drawn(
        "11111111", "11100000", "11100000", "10011000", "10011000", "10000110", "10000110", "10000001")),
    "variable ranges unidirectional": (VariableSparsityConfig(
        2, block=2, local_window_blocks=[2], global_block_indices=[2], global_block_end_indices=[4],
        attention="unidirectional"), drawn(
        "1000 0000", "1100 0000", "0010 0000", "0011 0000",
        "0011 1000", "0011 1100", "0011 0010", "0011 0011")),
    "bigbird": (BigBirdSparsityConfig(2, block=2, num_random_blocks=0, num_global_blocks=1), drawn(
        "11111111", "11100000", "11110000", "10111000", "10011100", "10001110", "10000111", "10000011")),
    "bslongformer": (BSLongformerSparsityConfig(2, block=2, global_block_indices=[2], global_block_end_indices=[4]), drawn(
        "11110000", "11110000", "11111111", "11111111", "00111100", "00111110", "00110111", "00110011")),
    "bslongformer unidirectional": (BSLongformerSparsityConfig(2, block=2, attention="unidirectional"), drawn(
        "10000000", "11000000", "11100000", "10110000", "10011000", "10001100", "10000110", "10000011")),
    "local sliding window": (LocalSlidingWindowSparsityConfig(2, block=2), drawn(
        "10000000", "11000000", "01100000", "00110000", "00011000", "00001100", "00000110", "00000011")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_the_drawing(name):
    config, expected = CASES[name]
    layout = config.make_layout(16)
    assert layout.dtype == torch.int64 and layout.shape == (2, 8, 8)
    assert torch.equal(layout[0], expected) and torch.equal(layout[1], expected)


def test_fixed_short_last_window_puts_its_global_block_as_far_right_as_fits():
    layout = FixedSparsityConfig(1, block=2).make_layout(12)[0]  # 6 blocks: windows of 4 and 2
    assert layout[:, 3].all() and layout[:, 5].all() and not layout[:4, 4].any()


def test_fixed_global_patterns_differ_per_head():
    layout = FixedSparsityConfig(4, block=2, different_layout_per_head=True, num_different_global_patterns=4
                                 ).make_layout(16)
    assert [int(torch.nonzero(layout[h, 0, :4].eq(1) & layout[h, 5, :4].eq(1))[0]) for h in range(4)] == [3, 2, 1, 0]


@pytest.mark.parametrize("make", [
    lambda: BigBirdSparsityConfig(2, block=2, num_random_blocks=2),
    lambda: VariableSparsityConfig(2, block=2, num_random_blocks=3),
])
def test_random_blocks_come_from_the_seed_not_the_global_rng(make):
    torch.manual_seed(1)
    first = make().make_layout(32)
    torch.manual_seed(2)
    assert torch.equal(make().make_layout(32), first)  # same on every rank, whatever the global RNG did
    other = make()
    other.seed = 5
    assert not torch.equal(other.make_layout(32), first)
    band = BigBirdSparsityConfig(2, block=2, num_random_blocks=0).make_layout(32)
    assert ((first - band) >= 0).all() or isinstance(make(), VariableSparsityConfig)
    assert (first.sum(-1) >= 2).all()


@pytest.mark.parametrize("config", [
    BigBirdSparsityConfig(2, block=2, num_random_blocks=2, attention="unidirectional"),
    VariableSparsityConfig(2, block=2, num_random_blocks=2, attention="unidirectional"),
    FixedSparsityConfig(2, block=2, num_local_blocks=4, num_global_blocks=2, attention="unidirectional"),
    BSLongformerSparsityConfig(2, block=2, attention="unidirectional"),
])
def test_unidirectional_layouts_are_lower_triangular(config):
    layout = config.make_layout(32)
    assert torch.equal(layout, layout.tril()) and layout.diagonal(dim1=1, dim2=2).all()


@pytest.mark.parametrize("config", [
    BigBirdSparsityConfig(2, block=2, num_random_blocks=0), BSLongformerSparsityConfig(2, block=2),
    LocalSlidingWindowSparsityConfig(2, block=2, attention="bidirectional"), FixedSparsityConfig(2, block=2, horizontal_global_attention=True),
])
def test_bidirectional_windows_are_symmetric(config):
    layout = config.make_layout(32)
    assert torch.equal(layout, layout.transpose(1, 2))


@pytest.mark.parametrize("make, message", [
    (lambda: DenseSparsityConfig(2, block=16).make_layout(40),
     "seq_len: must be a multiple of block (16); got 40. Pad the sequence to 48"),
    (lambda: FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3),
     "num_local_blocks: a positive multiple of num_global_blocks (3) is required; got 4."),
    (lambda: FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True),
     "horizontal_global_attention: needs attention \"bidirectional\"; got true with \"unidirectional\""),
    (lambda: FixedSparsityConfig(2, num_different_global_patterns=2),
     "num_different_global_patterns: more than 1 needs different_layout_per_head true; got 2"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_different_global_patterns=5),
     "num_different_global_patterns: at most num_local_blocks / num_global_blocks = 4 / 1 = 4 is required; got 5."),
    (lambda: VariableSparsityConfig(2, global_block_indices=[0, 4], global_block_end_indices=[2]),
     "global_block_end_indices: one end per start in global_block_indices (2) is required; got 1."),
    (lambda: BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[3]),
     "global_block_end_indices: each end must exceed its start; got start 3, end 3."),
    (lambda: BigBirdSparsityConfig(2, attention="causal"),
     "attention: one of ['bidirectional', 'unidirectional'] is required; got 'causal'."),
    (lambda: BigBirdSparsityConfig(2, block=2, num_random_blocks=9).make_layout(16),
     "num_random_blocks: at most the number of blocks in a row (8) is required; got 9."),
    (lambda: BigBirdSparsityConfig(2, block=2, num_sliding_window_blocks=9).make_layout(16),
     "num_sliding_window_blocks: at most the number of blocks in a row (8) is required; got 9."),
])
def test_bad_arguments_are_refused_by_name(make, message):
    with pytest.raises(SparsityConfigError) as e:
        make()
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)
