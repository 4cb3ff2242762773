"""Every bad config gives a message that names the key path, the value, what is allowed and a fix."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from shardwise.config import ConfigError, OptimizerConfig, SchedulerConfig, notes, parse_config
from shardwise.optim.param_groups import check_model_parameters
from shardwise.optim.registry import check_optimizer, check_scheduler

BASE = {"train_micro_batch_size_per_gpu": 4}


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Config notes are logged once per process: each test here sees its own, whatever ran before it."""
    monkeypatch.setattr(notes, "_given", set())

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
    ({**BASE, "optimizer": {"type": "AdamWW"}},
     "optimizer.type: must be one of adam, adamw, sgd, lamb, lion, adagrad, onebitadam, zerooneadam, onebitlamb (any case) or a "
     "torch.optim class name; "
     "got 'AdamWW'. Did you mean 'adamw'?"),
    ({**BASE, "optimizer": {"type": "Muon"}}, "optimizer.type: a DeepSpeed setting that shardwise does not implement yet (Muon)"),
    ({**BASE, "scheduler": {"type": "warmuplr"}},
     "scheduler.type: must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest or a "
     "torch.optim.lr_scheduler class name; got 'warmuplr'. Did you mean 'WarmupLR'?"),
    ({**BASE, "gradient_clipping": -1.0}, "gradient_clipping: input should be greater than or equal to 0; got -1.0."),
    ({**BASE, "zero_optimization": {"stage": 5}}, "zero_optimization.stage: input should be less than or equal to 3; got 5."),
    ({"train_micro_batch_size_per_gpu": "four"},
     'train_micro_batch_size_per_gpu: a whole number of samples, at least 1, is required; got "four" (a string). '
     "Write a number, e.g. 8."),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu: must be at least 1; got 0."),
    ({**BASE, "pipeline": {"schedule": "zb"}},
     "pipeline.schedule: must be one of 1f1b, gpipe, interleaved_1f1b; got 'zb'."),
    ({**BASE, "pipeline": {"stages": 0}},
     'pipeline.stages: a positive number of stages or "auto" is required; got 0.'),
    ({**BASE, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: needs ZeRO stage 1, 2 or 3; got stage 0. Set zero_optimization.stage."),
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


def test_auto_batch_sizes_are_derived_and_bucket_sizes_take_deepspeeds_default(tmp_path, caplog):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2, "bfloat16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                      "stage3_prefetch_bucket_size": "auto",
                                                      "stage3_param_persistence_threshold": "auto"},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}))
    with caplog.at_level(logging.INFO, logger="shardwise.config"):
        cfg = parse_config(path, dp_size=3)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 4, 2)
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)
    assert cfg.bf16.enabled and cfg.optimizer.type == "adamw" and cfg.optimizer.params == {"lr": 1e-3, "weight_decay": 0.1}
    assert ('config: "auto" resolved: train_batch_size=24 (derived), zero_optimization.reduce_bucket_size=500000000 '
            "(DeepSpeed's default), zero_optimization.stage3_prefetch_bucket_size=50000000 (DeepSpeed's default), "
            "zero_optimization.stage3_param_persistence_threshold=100000 (DeepSpeed's default).") in caplog.messages


def test_auto_where_a_guess_would_change_the_numerics_is_refused_listing_every_key():
    hf_style = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
                "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto"}}}
    with pytest.raises(ConfigError) as info:
        parse_config(hf_style, dp_size=1)
    assert info.value.problems[0] == (
        "gradient_clipping, fp16.enabled, bf16.enabled, optimizer.params.lr, optimizer.params.betas, optimizer.params.eps, "
        "optimizer.params.weight_decay, scheduler.params.warmup_min_lr, scheduler.params.warmup_max_lr, "
        "scheduler.params.warmup_num_steps: \"auto\" is a placeholder that Hugging Face's Trainer/accelerate fill in "
        "from TrainingArguments; outside them give a value or remove the key; got \"auto\".")
    # and nothing else is said about those keys (the batch keys, both "auto", say they need a value)
    assert [p.split(":")[0] for p in info.value.problems[1:]] == ["train_batch_size / train_micro_batch_size_per_gpu"]


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
        "comet: a DeepSpeed setting that shardwise does not act on yet; ignored (shardwise has no Comet monitor; use "
        "tensorboard, csv_monitor or wandb).") == 1


# --- messages that used to be vague: each names the key, the value and the fix -------------------------

@pytest.mark.parametrize("raw, problems", [
    ({"train_micro_batch_size_per_gpu": True},
     ["train_micro_batch_size_per_gpu: a whole number of samples, at least 1, is required; got true (a boolean). "
      "Write a number, e.g. 8."]),
    ({"train_micro_batch_size_per_gpu": "four", "gradient_accumulation_steps": 2},  # no false "required" lines
     ['train_micro_batch_size_per_gpu: a whole number of samples, at least 1, is required; got "four" (a string). '
      "Write a number, e.g. 8."]),
    ({"train_batch_size": 8, "gradient_accumulation_steps": "2"},
     ['gradient_accumulation_steps: a whole number of micro-steps, at least 1, is required; got "2" (a string). '
      "Write it without quotes: 2."]),
    ({"train_batch_size": 8.5}, ["train_batch_size: a whole number of samples, at least 1, is required; got 8.5. "
                                 "Write a whole number."]),
    ({**BASE, "zero_optimization": {"stage": True}},
     ["zero_optimization.stage: a number is required; got true (a boolean). Write the number, e.g. 0."]),
])
def test_batch_and_number_type_errors_say_what_to_write(raw, problems):
    with pytest.raises(ConfigError) as info:
        parse_config(raw, dp_size=2)
    assert info.value.problems == problems


def test_integral_float_batch_sizes_count_as_whole_numbers():
    cfg = parse_config({"train_batch_size": 8.0, "gradient_accumulation_steps": 2.0}, dp_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 2, 2)
    assert isinstance(cfg.train_batch_size, int)


@pytest.mark.parametrize("cfg, problem", [
    (OptimizerConfig(type="Adam", params={"lr": 1e-3, "betas": [0.9, 0.99, 0.5]}),
     "optimizer.params.betas: needs two numbers, e.g. [0.9, 0.999]; got [0.9, 0.99, 0.5] (3 values). Correct the "
     "value or remove the key to use the default."),
    (OptimizerConfig(type="AdamW", params={"lr": "3e-4"}),
     "optimizer.params.lr: needs a number; got '3e-4' (a string). Write it without quotes: 3e-4."),
    (OptimizerConfig(type="Lion", params={"weight_decay": "high"}),
     "optimizer.params.weight_decay: needs a number; got 'high' (a string). Correct the value or remove the key to "
     "use the default."),
])
def test_optimizer_params_are_checked_against_the_optimizers_arguments(cfg, problem):
    with pytest.raises(ConfigError) as info:
        check_optimizer(cfg)
    assert info.value.problems == [problem]


def test_scheduler_params_are_checked_before_the_scheduler_does_arithmetic_on_them():
    # Before: TypeError "unsupported operand type(s) for -: 'str' and 'float'" from inside WarmupLR.
    with pytest.raises(ConfigError) as info:
        check_scheduler(SchedulerConfig(type="WarmupLR", params={"warmup_max_lr": "1e-3", "warmup_num_steps": 10}))
    assert info.value.problems == [
        "scheduler.params.warmup_max_lr: needs a number or a list of numbers; got '1e-3' (a string). Write it without "
        "quotes: 1e-3."]


def test_frozen_or_foreign_model_parameters_are_named():
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"model_parameters: 2 of the 3 parameters given are not parameters of the "
                                         r"model passed as model= \(shapes \[1, 3\], \[1\]\)"):
        check_model_parameters([{"params": [model.weight, *other.parameters()]}], model, given=True)
    model.requires_grad_(False)
    with pytest.raises(ValueError) as info:
        check_model_parameters([{"params": list(model.parameters())}], model, given=True)
    assert str(info.value) == (
        "model_parameters: every parameter given is frozen (requires_grad=False), so nothing would train: weight, bias. "
        "Unfreeze the ones to train (p.requires_grad_(True)) before initialize, then pass "
        "[p for p in model.parameters() if p.requires_grad].")
    with pytest.raises(ValueError, match=r"got \(name, parameter\) pairs; pass model.parameters\(\), not named_parameters"):
        check_model_parameters([{"params": list(model.named_parameters())}], model, given=True)


# --- DeepSpeed keys and spellings --------------------------------------------------------------------------

def test_deepspeed_spellings_of_stage3_keys_reach_the_same_fields():
    bare = parse_config({**BASE, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 123, "param_persistence_threshold": 7, "max_live_parameters": 5000,
        "max_reuse_distance": 0, "gather_16bit_weights_on_model_save": True}}, dp_size=1)
    prefixed = parse_config({**BASE, "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 123, "stage3_param_persistence_threshold": 7,
        "stage3_max_live_parameters": 5000, "stage3_max_reuse_distance": 0,
        "stage3_gather_16bit_weights_on_model_save": True}}, dp_size=1)
    assert bare == prefixed
    assert bare.zero_optimization.stage3_prefetch_bucket_size == 123


def test_two_spellings_of_one_key_with_different_values_are_refused():
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})
    assert info.value.problems == [
        "zero_optimization.prefetch_bucket_size and zero_optimization.stage3_prefetch_bucket_size: two spellings of one "
        "setting with different values (1 and 2); keep one."]


def test_old_offload_flags_and_pin_memory():
    cfg = parse_config({**BASE, "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                      "cpu_offload_use_pin_memory": True}})
    zero = cfg.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == ("cpu", True)
    assert (zero.offload_param.device, zero.offload_param.pin_memory) == ("cpu", True)


@pytest.mark.parametrize("flag,value,fix", [
    ("cpu_offload", "yes", 'the offload_optimizer section ({"device": "cpu"})'),
    ("cpu_offload_param", 1, 'the offload_param section ({"device": "cpu"})'),
    ("cpu_offload_use_pin_memory", "true", "pin_memory in the offload sections"),
])
def test_old_offload_flags_that_are_not_booleans_are_refused(flag, value, fix):
    """A string or number there used to mean off without a word."""
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "zero_optimization": {"stage": 3, flag: value}})
    assert info.value.problems == [f"zero_optimization.{flag}: must be true or false; got {value!r}. Write true or "
                                   f"false, or use {fix} instead."]


def test_offload_param_below_stage3_is_ignored_with_a_note(caplog):
    cfg = parse_config({**BASE, "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param.device == "none"
    assert ("zero_optimization.offload_param: ignored below ZeRO stage 3, as DeepSpeed does (got stage 1); parameters "
            "stay on the device. Use offload_optimizer at stages 1-2, or stage 3.") in caplog.messages


@pytest.mark.parametrize("value", [math.inf, -math.inf, None])
def test_steps_per_print_infinity_means_never(value):
    assert parse_config({**BASE, "steps_per_print": value}).steps_per_print == math.inf


@pytest.mark.parametrize("raw, message", [
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
     "bf16.bf16_master_weights_and_grads: a DeepSpeed setting that shardwise does not implement yet without "
     "bf16.bf16_optimizer_states: true (bf16 master weights with fp32 optimizer state; DeepSpeed runs it only with "
     "offload_optimizer and DeepSpeedCPUAdam); got bf16_optimizer_states false."),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio: a DeepSpeed setting that shardwise does not implement yet for values "
     "other than 1.0 (partial optimizer offload); got 0.3. Remove it or set it to 1.0."),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine: a DeepSpeed setting that shardwise does not implement yet "
     "(the RLHF hybrid training/inference engine)"),
    ({"torch_autocast": {"enabled": True, "dtype": "float16"}},
     "torch_autocast.dtype: a DeepSpeed setting that shardwise does not implement yet for float16"),
    ({"data_parallel_size": 4}, "data_parallel_size: must equal the number of data-parallel ranks (2); got 4."),
    ({"data_types": {"param_dtype": "bfloat16"}},
     "data_types.param_dtype: must be the training dtype (fp32, from fp16/bf16.enabled); got 'bf16'."),
])
def test_deepspeed_features_not_implemented_are_refused_by_name(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **raw}, dp_size=2)
    assert message in str(info.value)


def test_switched_off_and_no_op_deepspeed_keys_are_accepted():
    cfg = parse_config({**BASE, "hybrid_engine": {"enabled": False, "max_out_tokens": 256}, "timers": {"throughput": {
        "enabled": True}}, "compile": {"deepcompile": False}, "checkpoint": {"load_universal": True,
        "tag_validation": "FAIL"}, "bf16": {"enabled": True, "immediate_grad_update": True, "check_grad_overflow": True},
        "data_types": {"grad_accum_dtype": "bfloat16", "param_dtype": "torch.bfloat16"}, "tensor_parallel": {
        "autotp_size": 0}, "expert_parallel": {"top_k": 2}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.bf16.check_grad_overflow
    assert cfg.data_types.grad_accum_dtype == cfg.data_types.param_dtype == "bf16"
    assert cfg.torch_autocast.enabled and cfg.torch_autocast.dtype == "bf16"


def test_bf16_check_grad_overflow_false_is_refused():
    # It would let a nan/inf step reach the weights; shardwise skips (or raises, nonfinite_grads) at every precision
    with pytest.raises(ConfigError, match=r"bf16.check_grad_overflow: .* for values other than true .*got false"):
        parse_config({**BASE, "bf16": {"enabled": True, "check_grad_overflow": False}})


def test_optimizer_section_without_type_builds_none_as_in_deepspeed(caplog):
    cfg = parse_config({**BASE, "optimizer": {"params": {"lr": 0.1}}})
    assert cfg.optimizer is None
    assert any(m.startswith("optimizer.params: ignored: the section has no `type`") for m in caplog.messages)


def test_torch_optimizer_and_scheduler_names_as_in_deepspeed():
    cfg = parse_config({**BASE, "optimizer": {"type": "RMSprop", "params": {"lr": 0.01}},
                        "scheduler": {"type": "StepLR", "params": {"step_size": 3}}})
    assert (cfg.optimizer.type, cfg.scheduler.type) == ("RMSprop", "StepLR")
    check_optimizer(cfg.optimizer)
    check_scheduler(cfg.scheduler)
