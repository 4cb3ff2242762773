"""Small DeepSpeed-named helpers: MoE parameter groups, unsupported features, OnDevice, the raw config view,
clone_tensors_for_torch_save, log_dist, the throughput timer."""

from __future__ import annotations

import logging

import pytest
import torch

from shardwise.checkpoint.fp32 import clone_tensors_for_torch_save
from shardwise.config import parse_config
from shardwise.moe import split_params_into_different_moe_groups_for_optimizer
from shardwise.monitor.console import log_dist
from shardwise.profiling.throughput import ThroughputTimer
from shardwise.unsupported import NotSupportedError, unsupported_class, unsupported_function
from shardwise.zero import OnDevice


def test_moe_groups_without_experts_come_back_unchanged():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": iter([a, b]), "name": "parameters"})
    assert len(groups) == 1 and groups[0]["params"] == [a, b] and groups[0]["name"] == "parameters"
    assert split_params_into_different_moe_groups_for_optimizer(({"params": [a]}, {"params": [b]}))[1]["params"] == [b]


def test_expert_parameters_are_refused():
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False  # how DeepSpeed marks an expert's parameter
    with pytest.raises(NotImplementedError, match="param group 0: holds expert"):
        split_params_into_different_moe_groups_for_optimizer({"params": [expert]})


def test_unsupported_features_refuse_when_used_not_when_imported():
    MoE = unsupported_class("deepspeed.moe.layer.MoE", "build the model without MoE layers.")
    init_inference = unsupported_function("deepspeed.init_inference", "use plain torch.")
    with pytest.raises(NotSupportedError, match=r"deepspeed.moe.layer.MoE: not supported by shardwise yet; build"):
        MoE(hidden_size=8, expert=None)
    with pytest.raises(NotImplementedError, match="deepspeed.init_inference: not supported"):
        init_inference(torch.nn.Linear(2, 2), dtype=torch.half)


def test_on_device_builds_on_meta_in_the_dtype_and_restores():
    with OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32 and torch.zeros(1).device.type == "cpu"
    with OnDevice(dtype=torch.half, enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    with pytest.raises(ValueError, match="floating-point dtype"):
        OnDevice(dtype=torch.int8)


def test_config_reads_like_deepspeeds_dict():
    raw = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto", "bfloat16": {"enabled": True},
           "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}}
    cfg = parse_config(raw, dp_size=2)
    assert cfg.get("zero_optimization", {}).get("stage") == 3 and cfg["gradient_accumulation_steps"] == "auto"
    assert "bfloat16" in cfg and "bf16" not in cfg and cfg.get("fp16") is None  # as given, not as resolved
    assert cfg.bf16.enabled and cfg.gradient_accumulation_steps == 1 and cfg.train_batch_size == 4  # typed: resolved
    raw["zero_optimization"]["stage"] = 0
    assert cfg["zero_optimization"]["stage"] == 3  # the parser keeps a copy of its own


def test_clone_tensors_for_torch_save_owns_its_storage():
    base = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": [base[:2]], "b": (base[5:], 3)})
    assert cloned["a"][0].untyped_storage().nbytes() == 8 and cloned["b"][1] == 3
    base.zero_()
    assert cloned["a"][0].tolist() == [0.0, 1.0] and cloned["b"][0][0] == 5.0


def test_log_dist_without_a_process_group_logs(caplog):
    with caplog.at_level(logging.INFO, logger="shardwise"):
        log_dist("hello", ranks=[0])
    assert "[Rank 0] hello" in caplog.text


def test_throughput_timer_skips_warm_up_steps(monkeypatch):
    clock = iter([0.0, 10.0, 11.0, 12.0, 13.0])
    monkeypatch.setattr("shardwise.profiling.throughput.time.perf_counter", lambda: next(clock))
    timer = ThroughputTimer(batch_size=8, start_step=2)
    assert timer.avg_samples_per_sec() == float("-inf")
    for _ in range(5):
        timer.step_done()
    assert timer.global_step_count == 5 and timer.avg_samples_per_sec() == pytest.approx(8 * 3 / 3.0)
    timer.update_epoch_count()
    assert timer.epoch_count == 1
