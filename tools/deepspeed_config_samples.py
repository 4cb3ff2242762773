"""Sample values for tools/deepspeed_config_keys.py where its generic rule (the opposite bool, twice the
default number, the default string) cannot make one, and the keys a sample needs beside it ("context").
Every sample is checked against DeepSpeedConfig when the catalogue is written."""

from __future__ import annotations

from typing import Any

# Set by code, never from JSON (a torch.dtype, a process group, a Python object): no sample.
CODE_ONLY = {"tensor_parallel.dtype", "tensor_parallel.tensor_parallel.mpu", "tensor_parallel.tensor_parallel.tp_group",
             "tensor_parallel.injection_policy_tuple"}

# Samples the generic rule cannot make (None defaults, values that need a choice) or that need other
# keys beside them to be valid ("context", merged into the config).
SAMPLES: dict[str, Any] = {
    "communication_data_type": "bf16",
    "seq_parallel_communication_data_type": "bf16",
    "gradient_allreduce_op": "sum",
    "steps_per_print": 100,
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "log_level": "info",
    "optimizer.type": "AdamW",
    "optimizer.params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
    "scheduler.type": "WarmupLR",
    "scheduler.params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 10},
    "torch_autocast.dtype": "bfloat16",
    "torch_autocast.lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"],
    "data_types.grad_accum_dtype": "fp32",
    "data_types.param_dtype": "bf16",
    "data_types.buffer_dtype": "fp32",
    "data_types.keep_in_fp32_modules": ["norm"],
    "checkpoint.tag_validation": "Fail",
    "checkpoint.writer.type": "fast",
    "checkpoint.writer.data_parallel": "socket",
    "zero_optimization.stage": 2,
    "zero_optimization.offload_param.device": "cpu",
    "zero_optimization.offload_param.nvme_path": "/local_nvme",
    "zero_optimization.offload_optimizer.device": "cpu",
    "zero_optimization.offload_optimizer.nvme_path": "/local_nvme",
    "zero_optimization.cpu_offload_param": True,
    "zero_optimization.compute_grad_norm": False,
    "zero_optimization.model_persistence_threshold": 1_000_000,
    "zero_optimization.stage3_model_persistence_threshold": 1_000_000,
    "flops_profiler.module_depth": 2,
    "zero_optimization.leaf_module.classes": ["MyMoEBlock"],
    "zero_optimization.leaf_module.names": ["block.0"],
    "zero_optimization.leaf_module.name_suffixes": ["experts"],
    "zero_optimization.zenflow.select_strategy": "step",
    "zero_optimization.zenflow.select_interval": 10,
    "zero_optimization.zenflow.update_interval": 4,
    "zero_optimization.zenflow.pt_reserved_cores_perc": 0.25,
    "zero_optimization.zenflow.steps_per_epoch": 100,
    "compile.passes": ["z1"],
    "data_efficiency.data_sampling.dynamic_batching.max_batch_size": 8,
    "data_efficiency.data_sampling.dynamic_batching.max_tokens": 2048,
    "tensor_parallel.autotp_size": 2,
    "tensor_parallel.vocab_parallel_ce_backend": "torch",
    "tensor_parallel.preset_model": "llama",
    "tensor_parallel.partition_config": {"use_default_specs": True},
    "activation_checkpointing.number_checkpoints": 4,
    "flops_profiler.output_file": "flops.txt",
    "wandb.group": "runs", "wandb.team": "team",
    "comet.project": "p", "comet.workspace": "w", "comet.api_key": "k", "comet.experiment_name": "e",
    "comet.experiment_key": "a" * 32, "comet.online": False, "comet.mode": "get_or_create",
    "comms_logger.prof_ops": ["all_reduce"],
    "autotuning.metric_path": "metrics.json", "autotuning.model_info_path": "model_info.json",
    "autotuning.tuner_type": "random", "autotuning.metric": "latency",
    "datastates_ckpt": {"host_cache_size": 16},
    "expert_parallel.enabled": True,
    "hybrid_engine.enabled": True,
    "aio.use_gds": False,
}
CONTEXT: dict[str, dict[str, Any]] = {
    "zero_optimization.offload_optimizer.ratio": {"zero_optimization": {"stage": 3}},
    "zero_optimization.offload_optimizer.super_offload": {"zero_optimization": {"stage": 3}},
    "zero_optimization.offload_optimizer.nvme_path": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
    "zero_optimization.offload_param.nvme_path": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
    "zero_optimization.offload_param.device": {"zero_optimization": {"stage": 3}},
    "zero_optimization.offload_optimizer.device": {"zero_optimization": {"stage": 2}},
    "zero_optimization.cpu_offload": {"zero_optimization": {"stage": 2}},
    "zero_optimization.cpu_offload_param": {"zero_optimization": {"stage": 3}},
    "zero_optimization.compute_grad_norm": {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0},
    "fp16.fp16_master_weights_and_grads": {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "bf16.bf16_master_weights_and_grads": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "bf16.bf16_optimizer_states": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                                   "zero_optimization": {"stage": 2}},
    "bfloat16.bf16_master_weights_and_grads": {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "bfloat16.bf16_optimizer_states": {"bfloat16": {"enabled": True, "bf16_master_weights_and_grads": True},
                                       "zero_optimization": {"stage": 2}},
    "data_efficiency.data_sampling.curriculum_learning.enabled": {
        "data_efficiency": {"data_sampling": {"curriculum_learning": {"curriculum_metrics": {}}}}},
    "data_efficiency.data_sampling.dynamic_batching.enabled": {
        "data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 2048}}}},
    "data_types.param_dtype": {"bf16": {"enabled": True}},  # DeepSpeed checks it against bf16 at initialize
    "torch_autocast.dtype": {"torch_autocast": {"enabled": True}},
    "torch_autocast.lower_precision_safe_modules": {"torch_autocast": {"enabled": True}},
}
