"""The `sparse_attention` config section: parsed per mode, foreign keys refused with the mode's key list, and
built into the SparsityConfig a layout comes from; the compatibility imports."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError, parse_config
from shardwise.sparse_attention import (BigBirdSparsityConfig, DenseSparsityConfig, FixedSparsityConfig,
                                        apply_sparse_attention, sparsity_config_from)
from shardwise.sparse_attention.hf import SparseModelError

BASE = {"train_micro_batch_size_per_gpu": 1}


def test_fixed_section_builds_deepspeeds_fixed_layout():
    cfg = parse_config({**BASE, "sparse_attention": {"mode": "fixed", "block": 2, "num_local_blocks": 2,
                                                    "attention": "unidirectional"}})
    built = sparsity_config_from(cfg.sparse_attention, num_heads=4)
    assert isinstance(built, FixedSparsityConfig) and (built.block, built.num_local_blocks) == (2, 2)
    assert torch.equal(built.make_layout(16), FixedSparsityConfig(4, block=2, num_local_blocks=2,
                                                                 attention="unidirectional").make_layout(16))


def test_bigbird_takes_deepspeeds_config_default_of_no_random_blocks_and_dense_follows_the_model():
    cfg = parse_config({**BASE, "sparse_attention": {"mode": "bigbird"}})
    built = sparsity_config_from(cfg.sparse_attention, num_heads=2)
    assert isinstance(built, BigBirdSparsityConfig) and built.num_random_blocks == 0 and built.block == 16
    dense = sparsity_config_from(parse_config({**BASE, "sparse_attention": {"mode": "dense"}}).sparse_attention, 2,
                                 causal=True)
    assert isinstance(dense, DenseSparsityConfig) and dense.attention == "unidirectional"


def test_disabled_section_is_none():
    assert parse_config({**BASE, "sparse_attention": {"enabled": False, "mode": "fixed"}}).sparse_attention is None
    assert parse_config(BASE).sparse_attention is None


@pytest.mark.parametrize("section, message", [
    ({"mode": "bigbird", "num_local_blocks": 4},
     "sparse_attention.num_local_blocks: not a key of mode 'bigbird' (its keys: num_random_blocks, "
     "num_sliding_window_blocks, num_global_blocks, attention); got num_local_blocks. Remove it or change mode."),
    ({"mode": "dense", "attention": "unidirectional"},
     "sparse_attention.attention: not a key of mode 'dense' (its keys: none beyond block and different_layout_per_head)"),
    ({"mode": "sparse"}, "sparse_attention.mode"),
    ({"mode": "fixed", "attention": "causal"}, "sparse_attention.attention"),
])
def test_bad_sections_are_refused(section, message):
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, "sparse_attention": section})
    assert message in str(e.value)


def test_a_model_that_cannot_be_switched_is_refused():
    cfg = parse_config({**BASE, "sparse_attention": {"mode": "fixed"}})
    with pytest.raises(SparseModelError, match="model: a transformers PreTrainedModel .* is required .* got Linear. "
                       "Build shardwise.sparse_attention.SparseSelfAttention into the model's attention yourself"):
        apply_sparse_attention(nn.Linear(2, 2), cfg.sparse_attention)


def test_deepspeed_names_are_shardwises():
    from deepspeed.ops.sparse_attention import FixedSparsityConfig as DSFixed
    from deepspeed.ops.sparse_attention import SparseAttentionUtils, SparseSelfAttention

    import shardwise.sparse_attention as sa

    assert (DSFixed, SparseSelfAttention, SparseAttentionUtils) == (sa.FixedSparsityConfig, sa.SparseSelfAttention,
                                                                   sa.SparseAttentionUtils)
