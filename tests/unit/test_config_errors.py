"""Every bad config gives a message that names the key path, the value, what is allowed and a fix."""

from __future__ import annotations

import json

import pytest

from shardwise.config import ConfigError, parse_config

BASE = {"train_micro_batch_size_per_gpu": 4}

CASES = [
    (
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        "train_batch_size (32) != train_micro_batch_size_per_gpu (4) × gradient_accumulation_steps (2) × "
        "data-parallel size (2) = 16; drop one of the three keys to have it derived.",
    ),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4},
     "train_batch_size (30) is not divisible by gradient_accumulation_steps (4) × data-parallel size (2) = 8"),
    ({"gradient_accumulation_steps": 4}, "train_batch_size / train_micro_batch_size_per_gpu: at least one is required"),
    ({**BASE, "optimizer": {"type": "Adam", "parms": {}}}, "optimizer.parms: unknown key. Did you mean 'params'?"),
    ({**BASE, "fp16": {"enabled": True, "loss_scal": 0}}, "fp16.loss_scal: unknown key. Did you mean 'loss_scale'?"),
    ({**BASE, "train_batch_sise": 8}, "train_batch_sise: unknown key. Did you mean 'train_batch_size'?"),
    ({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled: at most one may be true"),
    ({**BASE, "optimizer": {"type": "Adamax"}}, "optimizer.type: must be one of adam, adamw, sgd, lamb, adagrad; got 'adamax'. Did you mean 'adam'?"),
    ({**BASE, "scheduler": {"type": "warmuplr"}}, "scheduler.type: must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest; got 'warmuplr'. Did you mean 'WarmupLR'?"),
    ({**BASE, "gradient_clipping": -1.0}, "gradient_clipping: input should be greater than or equal to 0; got -1.0."),
    ({**BASE, "zero_optimization": {"stage": 5}}, "zero_optimization.stage: input should be less than or equal to 3; got 5."),
    ({"train_micro_batch_size_per_gpu": "four"}, "train_micro_batch_size_per_gpu: input should be a valid integer"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu: input should be greater than or equal to 1; got 0."),
    ({**BASE, "pipeline": {"stages": 2}},
     "pipeline: a DeepSpeed setting that shardwise does not implement yet"),
    ({**BASE, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: needs ZeRO stage 1, 2 or 3; got stage 0. Set zero_optimization.stage."),
    ({**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param: needs ZeRO stage 3; got stage 2."),
    ({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     'zero_optimization.offload_param.nvme_path: required when device is "nvme"; got none.'),
    ({**BASE, "communication_data_type": "int8"}, "communication_data_type: must be one of fp32, fp16, bf16; got 'int8'."),
    ({**BASE, "fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window: input should be greater than or equal to 1; got 0."),
    ({**BASE, "zero_optimization": {"stage": 0, "reduce_bucket_sise": 10}}, "zero_optimization.reduce_bucket_sise: unknown key. Did you mean 'reduce_bucket_size'?"),
]


@pytest.mark.parametrize("raw, message", CASES, ids=[m[:40] for _, m in CASES])
def test_bad_config_message(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config(raw, dp_size=2)
    assert message in str(info.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "gradient_clipping": -1, "fp16": {"hysteresis": 0}, "unknown_key": 1}, dp_size=1)
    assert len(info.value.problems) == 3
    assert str(info.value).startswith("3 problems in the config:")


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        parse_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 4,\n "x": }')
    with pytest.raises(ConfigError, match=r"not valid JSON at line 2, column 7"):
        parse_config(bad)


def test_auto_aliases_and_derivation(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2, "bfloat16": {"enabled": True},
                                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}}}))
    cfg = parse_config(path, dp_size=3)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 4, 2)
    assert cfg.bf16.enabled and cfg.optimizer.type == "adamw" and cfg.optimizer.params == {"weight_decay": 0.1}


@pytest.mark.parametrize("given, expected", [
    ({"train_batch_size": 16}, (16, 8, 1)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (16, 2, 4)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, (16, 2, 4)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, (16, 2, 4)),
    ({"train_micro_batch_size_per_gpu": 2}, (4, 2, 1)),
])
def test_batch_triangle(given, expected):
    cfg = parse_config(given, dp_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_disabled_deepspeed_sections_are_dropped_quietly(caplog):
    cfg = parse_config({**BASE, "sparse_attention": {"enabled": False}, "zero_optimization": {
        "offload_optimizer": {"device": "none"}}}, dp_size=1)
    assert cfg.zero_optimization.stage == 0
    assert not caplog.records


def test_cosmetic_deepspeed_key_warns_once(caplog):
    parse_config({**BASE, "comet": {"enabled": True}}, dp_size=1)
    parse_config({**BASE, "comet": {"enabled": True}}, dp_size=1)
    assert [r.getMessage() for r in caplog.records].count(
        "comet: a DeepSpeed setting that shardwise does not act on yet; ignored.") == 1
