"""DeepSpeed's bf16 master-weight keys in the config and the memory planner (the runs are
tests/distributed/test_bf16_master_weights.py): which combinations are refused, and the bytes planned."""

from __future__ import annotations

import pytest

from shardwise.config import ConfigError, parse_config
from shardwise.planner import ModelShape, plan

BF16_FULL = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}


def test_fp32_masters_stay_the_default():
    """Without the keys nothing changes: fp32 masters and fp32 state beside bf16 parameters."""
    shape = ModelShape(trainable=1000, module_sizes=(1000,))
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    mixed = plan(shape, {**base, "bf16": {"enabled": True}}, 2)
    full = plan(shape, {**base, **BF16_FULL}, 2)
    assert mixed.part("master_weights").device == 2000 and full.part("master_weights").device == 0
    assert mixed.part("optimizer_state").device == 4000 and full.part("optimizer_state").device == 2000
    assert mixed.part("gradients").device == 2000 and full.part("gradients").device == 1000


@pytest.mark.parametrize("bf16, zero, message", [
    ({"bf16_master_weights_and_grads": True}, {"stage": 2},
     "bf16.bf16_master_weights_and_grads: a DeepSpeed setting that shardwise does not implement yet without "
     "bf16.bf16_optimizer_states: true"),
    ({"bf16_optimizer_states": True}, {"stage": 2},
     "bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads: true (DeepSpeed refuses this too)"),
    ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, {"stage": 0},
     "bf16.bf16_master_weights_and_grads: needs ZeRO stage 1, 2 or 3, as in DeepSpeed"),
    ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
     {"stage": 2, "offload_optimizer": {"device": "cpu"}},
     "bf16.bf16_master_weights_and_grads: a DeepSpeed setting that shardwise does not implement yet with "
     "zero_optimization.offload_optimizer"),
])
def test_combinations_that_cannot_run_are_refused(bf16, zero, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, **bf16},
                      "zero_optimization": zero}, dp_size=1)
    assert message in str(info.value)


def test_fp32_gradient_accumulation_is_refused_with_bf16_gradients():
    with pytest.raises(ConfigError, match="data_types.grad_accum_dtype: must be bf16"):
        parse_config({"train_micro_batch_size_per_gpu": 1, **BF16_FULL, "zero_optimization": {"stage": 1},
                      "data_types": {"grad_accum_dtype": "fp32"}}, dp_size=1)


def test_the_keys_without_bf16_are_refused():
    with pytest.raises(ConfigError, match=r"bf16.bf16_master_weights_and_grads: needs bf16.enabled: true"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                      "bf16": {"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
                     dp_size=1)


def test_offloaded_stage3_parameters_keep_a_bf16_master_slice_on_the_device():
    """With offload_param the stored slice is on the host, so the slice the optimizer steps is a separate bf16 copy."""
    shape = ModelShape(trainable=1000, module_sizes=(1000,))
    cfg = {"train_micro_batch_size_per_gpu": 1, **BF16_FULL,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"}}}
    planned = plan(shape, cfg, 2)
    assert planned.part("master_weights").device == 2 * 1000 // 2
    assert planned.part("optimizer_state").device == 4 * 1000 // 2
    assert planned.part("parameters").host == 2 * 1000 // 2
