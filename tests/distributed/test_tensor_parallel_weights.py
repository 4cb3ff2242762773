"""Whole weights out of a tensor-parallel engine: `save_16bit_model` and `_consolidated_16bit_state_dict`
(accelerate's call for AutoTP) reassemble every split parameter; at ZeRO-3 they refuse and name the way out."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.harness import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                n_positions=16))


def _save(out: str, stage: int) -> dict[str, torch.Tensor] | None:
    import shardwise

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = shardwise.initialize(model=_model(), config=config)
    engine.save_16bit_model(out)
    whole = engine._consolidated_16bit_state_dict()
    return None if whole is None else {k: v.clone() for k, v in whole.items()}


def test_whole_weights_of_a_split_model_equal_the_model_it_was_split_from(tmp_path):
    results = run_distributed(_save, 4, str(tmp_path), 1)
    want = _model().state_dict()
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert results[1:] == [None, None, None]
    for got in (results[0], saved):
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), name  # the fused c_attn reassembled block by block


def test_whole_weights_at_zero_stage_3_are_refused_with_the_way_out(tmp_path):
    with pytest.raises(AssertionError) as info:
        run_distributed(_save, 2, str(tmp_path), 3)
    assert ("save_16bit_model: whole weights of a tensor-parallel model at ZeRO stage 3 are not gathered in memory; "
            "save a checkpoint (engine.save_checkpoint) and run `shardwise checkpoint to-fp32 <save_dir> <out_dir>`, "
            "which reassembles every split parameter by name.") in str(info.value)
