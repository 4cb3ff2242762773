"""Valid DeepSpeed config keys that shardwise does not act on (yet), and how each is treated.

The rule (CONVENTIONS.md): a key that would change numerics or memory is refused, so nobody trains a
different model than they configured; a cosmetic key (logging, profiling) draws a one-time warning.
A section switched off (`{"enabled": false}`, an offload to device "none") is dropped quietly: it asks
for nothing we fail to do.
"""

from __future__ import annotations

COSMETIC = "cosmetic"
CHANGES_TRAINING = "changes training"

ROOT_KEYS: dict[str, str] = {
    "comet": COSMETIC,
    "monitor": COSMETIC,
    "dump_state": COSMETIC,
    "autotuning": COSMETIC,
    "zero_allow_untested_optimizer": COSMETIC,
    "zero_force_ds_cpu_optimizer": COSMETIC,
    "amp": CHANGES_TRAINING,
    "sparse_gradients": CHANGES_TRAINING,
    "pipeline": CHANGES_TRAINING,
    "elasticity": CHANGES_TRAINING,
    "compression_training": CHANGES_TRAINING,
    "curriculum_learning": CHANGES_TRAINING,
    "data_efficiency": CHANGES_TRAINING,
    "sparse_attention": CHANGES_TRAINING,
    "gradient_accumulation_dtype": CHANGES_TRAINING,
}

ZERO_KEYS: dict[str, str] = {
    "zero_quantized_weights": CHANGES_TRAINING,
    "zero_quantized_gradients": CHANGES_TRAINING,
    "zero_hpz_partition_size": CHANGES_TRAINING,
    "mics_shard_size": CHANGES_TRAINING,
    # Tuning knobs that shape speed only.
    "load_from_fp32_weights": COSMETIC,
    "ignore_unused_parameters": COSMETIC,
    "legacy_stage1": COSMETIC,
    "memory_efficient_linear": COSMETIC,
    "use_multi_rank_bucket_allreduce": COSMETIC,
    "override_module_apply": COSMETIC,
    "mics_hierarchical_params_gather": COSMETIC,
    "pipeline_loading_checkpoint": COSMETIC,
}

# DeepSpeed spellings that mean the same as one of ours.
ROOT_ALIASES: dict[str, str] = {"bfloat16": "bf16", "zero_optimization_stage": "zero_optimization.stage"}

# Old DeepSpeed spellings inside zero_optimization: a true flag means offload to the CPU.
ZERO_FLAG_ALIASES: dict[str, str] = {"cpu_offload": "offload_optimizer", "cpu_offload_params": "offload_param"}


def is_switched_off(value: object) -> bool:
    """True for a section that asks for nothing: `{"enabled": false}`, `false`, or an offload to "none"."""
    if value is False or value is None:
        return True
    if isinstance(value, dict):
        if value.get("enabled") is False:
            return True
        device = value.get("device")
        return device is not None and str(device).lower() == "none"
    return False
