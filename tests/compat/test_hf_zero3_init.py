"""`from_pretrained` under a live `HfDeepSpeedConfig` at ZeRO-3 goes through transformers' own path
(`deepspeed.zero.Init(config_dict_or_path=...)`, `initialize_weights_zero3`, `_load_state_dict_into_zero3_model`)
into shardwise's `zero.Init`: every parameter arrives partitioned (DeepSpeed's attributes, an empty local
tensor) and gathers back to exactly the saved weights, on every rank."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.harness import run_distributed


def _load(path: str):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers import LlamaForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    deepspeed.init_distributed()
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})  # noqa: F841
    assert is_deepspeed_zero3_enabled()
    model = LlamaForCausalLM.from_pretrained(path)
    params = dict(model.named_parameters())
    partitioned = {n: (p.numel(), p.ds_numel, tuple(p.ds_shape), p.ds_status is ZeroParamStatus.NOT_AVAILABLE)
                   for n, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        whole = {n: p.detach().clone() for n, p in params.items()}
    return partitioned, whole


def test_from_pretrained_under_zero3_is_partitioned_and_exact(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
                     ).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    for partitioned, whole in run_distributed(_load, 2, str(tmp_path)):
        assert set(whole) == set(saved)
        for name, (local, ds_numel, ds_shape, not_available) in partitioned.items():
            assert local == 0 and not_available and ds_numel == saved[name].numel() and ds_shape == saved[name].shape
            torch.testing.assert_close(whole[name], saved[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
