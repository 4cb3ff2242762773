"""Top-level "section.key" entries, which TRL's and accelerate's prepare_deepspeed write
("zero_optimization.reduce_bucket_size": hidden_size ** 2): DeepSpeed 0.19.8 reads settings inside their sections
only, so it ignores them; shardwise does the same and says so once. A dotted key naming no section stays an
unknown key."""

from __future__ import annotations

import logging

import pytest

from shardwise.config import ConfigError, parse_config
from shardwise.config import notes


def test_dotted_section_keys_are_ignored_as_deepspeed_ignores_them(caplog):
    notes._given.clear()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000},
              "zero_optimization.reduce_bucket_size": 1024, "zero_optimization.stage3_prefetch_bucket_size": 921.6}
    with caplog.at_level(logging.WARNING, logger="shardwise.config"):
        cfg = parse_config(config)
    assert cfg.zero_optimization.reduce_bucket_size == 1000  # the section's own value
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000  # DeepSpeed's default, unchanged
    [message] = [m for m in caplog.messages if "top-level key with a dot" in m]
    assert "zero_optimization.reduce_bucket_size=1024" in message
    assert "zero_optimization.stage3_prefetch_bucket_size=921.6" in message


def test_a_dotted_key_naming_no_section_is_unknown():
    with pytest.raises(ConfigError, match="zero_optimisation.stage: unknown key"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimisation.stage": 3})
