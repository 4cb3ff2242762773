"""`init_inference`'s config: DeepSpeed's keys and aliases are read, a typo gets "did you mean", keys for features
shardwise has no inference path for are refused by name, and dtypes are given as torch dtypes or strings."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.config import ConfigError
from shardwise.config.inference import parse_inference_config


def parse(config=None, **kwargs):
    return parse_inference_config(config, kwargs)


def refusal(config=None, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        parse(config, **kwargs)
    return str(caught.value)


def test_defaults_keep_the_model_dtype_and_one_rank():
    cfg = parse()
    assert (cfg.tp_size, cfg.dtype, cfg.max_out_tokens, cfg.checkpoint, cfg.int8_weights) == (1, None, 1024, None, False)


def test_unknown_keys_get_did_you_mean_at_their_level():
    assert refusal(tensor_paralel={"tp_size": 2}).startswith(
        "init_inference: tensor_paralel: unknown key. Did you mean 'tensor_parallel'? Keys allowed: args, base_dir, ")
    assert refusal(tensor_parallel={"tp_sise": 2}) == (
        "init_inference: tensor_parallel.tp_sise: unknown key. Did you mean 'tp_size'? Keys allowed: enabled, mpu, "
        "tp_grain_size, tp_group, tp_size.")
    # under an alias, the keys of the aliased section are offered
    assert "tp.tp_sise: unknown key. Did you mean 'tp_size'?" in refusal(tp={"tp_sise": 2})


def test_aliases_and_deepspeed_spellings():
    assert parse(tp={"tp_size": 2}).tp_size == 2
    assert parse(mp_size=2).tp_size == 2
    assert parse(mp_size=2, tensor_parallel={"tp_size": 2}).tp_size == 2
    assert parse(tensor_parallel={"tp_size": 4, "enabled": False}).tp_size == 1
    assert parse(max_tokens=77).max_out_tokens == 77
    assert parse(kernel_inject=True).replace_with_kernel_inject is True
    assert parse(injection_dict={"X": ("o",)}).injection_policy == {"X": ("o",)}
    assert refusal(mp_size=2, tensor_parallel={"tp_size": 4}) == (
        "init_inference: mp_size (2) and tensor_parallel.tp_size (4) differ; give tp_size only.")


def test_keywords_override_the_dict_and_a_json_file_is_read(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp16", "tensor_parallel": {"tp_size": 2}, "max_out_tokens": 64}))
    cfg = parse(str(path), dtype="bf16")
    assert (cfg.dtype, cfg.tp_size, cfg.max_out_tokens) == (torch.bfloat16, 2, 64)


@pytest.mark.parametrize(("given", "dtype"), [("bf16", torch.bfloat16), ("torch.float16", torch.float16),
                                              ("fp32", torch.float32), ("BFloat16", torch.bfloat16),
                                              (torch.half, torch.float16), ("int8", torch.int8)])
def test_dtype_strings(given, dtype):
    assert parse(dtype=given).dtype is dtype


def test_an_unknown_dtype_is_refused():
    assert refusal(dtype="int4") == ("init_inference: dtype: one of torch.float32, torch.bfloat16, torch.float16 (or "
                                     "\"fp32\", \"bf16\", \"fp16\"); got 'int4'.")


def test_int8_is_asked_for_by_dtype_or_by_quant():
    assert parse(dtype=torch.int8).int8_weights and parse(quant={"enabled": True}).int8_weights
    assert not parse(quant={"enabled": True, "weight": {"enabled": False}}).int8_weights


@pytest.mark.parametrize(("key", "value", "message"), [
    ("moe", True, "init_inference: moe: mixture-of-experts inference is not built in shardwise; got True. Remove it."),
    ("zero", {"stage": 3}, "init_inference: zero: ZeRO-Inference (weights streamed from CPU/NVMe per layer) is not "
     "built in shardwise; tensor parallelism with int8 weights (quant) is how a model too large for one device is "
     "served; got {'stage': 3}. Remove it."),
    ("save_mp_checkpoint_path", "/tmp/out", "init_inference: save_mp_checkpoint_path: shardwise does not write a "
     "resharded copy: it loads any checkpoint at any tp_size directly; got '/tmp/out'. Remove it."),
    ("checkpoint_config", {"tag": "x"}, "init_inference: checkpoint_config: not read by shardwise; pass checkpoint= "
     "and base_dir=; got {'tag': 'x'}. Remove it."),
    ("keep_module_on_host", True, "init_inference: keep_module_on_host: not built in shardwise; got True. Remove it."),
    ("training_mp_size", 2, "init_inference: training_mp_size: shardwise checkpoints record their own split and load "
     "at any tp_size; Megatron checkpoints are not read; got 2. Remove it."),
])
def test_features_without_an_inference_path_are_refused_by_name(key, value, message):
    assert refusal(**{key: value}) == message


def test_quantization_other_than_int8_weights_is_refused():
    assert refusal(quant={"enabled": True, "weight": {"num_bits": 4}}) == (
        "init_inference: quant.weight: shardwise quantizes weights to symmetric int8 with one scale per output "
        "channel; got num_bits=4, q_type='symmetric', q_groups=1. Use num_bits 8, q_type \"symmetric\", q_groups 1.")
    assert refusal(quant={"enabled": True, "activation": {"enabled": True}}) == (
        "init_inference: quant.activation.enabled: shardwise quantizes weights only; set it to false.")


def test_ranges_and_groups():
    assert refusal(max_out_tokens=0) == "init_inference: max_out_tokens: input should be greater than 0; got 0."
    assert refusal(min_out_tokens=10, max_out_tokens=5) == (
        "init_inference: min_out_tokens (10) exceeds max_out_tokens (5).")
    assert refusal(tensor_parallel={"tp_size": 2, "tp_group": object()}) == (
        "init_inference: tensor_parallel.mpu / tp_group: shardwise builds the tensor-parallel group itself from the "
        "world (tp_size ranks per replica); drop them and set tp_size.")


def test_every_problem_is_listed_at_once():
    message = refusal(max_out_tokens=0, dtyp="bf16")
    assert message.startswith("2 problems in the config:\n")
    assert "dtyp: unknown key. Did you mean 'dtype'?" in message and "max_out_tokens: input should be" in message


def test_checkpoint_is_a_path_a_descriptor_or_a_weight_source(tmp_path):
    from shardwise.inference.sources import Chain

    assert parse(checkpoint=tmp_path).checkpoint == str(tmp_path)
    assert parse(checkpoint={"type": "ds_model", "checkpoints": ["a.safetensors"]}).checkpoint["type"] == "ds_model"
    source = Chain()
    assert parse(checkpoint=source).checkpoint is source
    assert refusal(checkpoint=3) == ("init_inference: checkpoint: a path (a shardwise checkpoint, a safetensors "
                                     "folder, a descriptor JSON), a descriptor dict or a weight source (an object with find, shape and read); got int.")
