"""Every DeepSpeed 0.19.8 config key and what shardwise does with it: the one table.

Four treatments (CONVENTIONS.md, "Config"):
- implemented: shardwise acts on the key (a typed field in `sections.py`, or a spelling `parse.py`
  renames to one).
- no-op: accepted with no effect, for the reason given: a speed knob whose effect shardwise gets
  another way, or a setting whose only value is what shardwise always does. Noted once (INFO).
- no-op, warned: accepted, but it asks for output shardwise does not produce; warned once.
- refused: a feature shardwise does not have that would change what is trained or where memory goes.
  A section that asks for nothing (`{"enabled": false}`, `false`, an offload to "none"; for `off=
  UNLESS_ENABLED` sections, anything without an `"enabled": true` inside) is dropped quietly. A key
  with `accepts` is refused only for values other than those (the values shardwise's behaviour equals).
  `tensor_parallel` asks for nothing unless `autotp_size` > 0 (DeepSpeed's own switch).

Keys are dotted paths; `section.*` covers a section and everything in it. `ALIASES` maps DeepSpeed's
other spellings onto shardwise's field names. `docs/reference/config.md` is rendered from this table
(`python -m shardwise.config.key_docs`), and tests/unit/test_config_keys.py walks DeepSpeed's own key
catalogue (tests/data/deepspeed_0_19_8_config_keys.json) through the parser.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

IMPLEMENTED, NO_OP, WARNED, REFUSED = "implemented", "no-op", "no-op (warned)", "refused"
DISABLED, UNLESS_ENABLED, UNLESS_AUTOTP = "disabled", "unless-enabled", "unless-autotp"
DERIVE, DEFAULT = "derive", "default"


@dataclass(frozen=True)
class Treatment:
    kind: str
    reason: str
    accepts: tuple[Any, ...] | None = None
    """Values accepted (they equal shardwise's behaviour); any other value is refused."""
    off: str = DISABLED
    """When a refused section asks for nothing (see the module docstring)."""
    auto: str | None = None
    """What "auto" means here: DERIVE (the batch triangle) or DEFAULT (DeepSpeed's default); None refuses
    it, except at no-op keys, where any value is accepted."""


def impl(reason: str, auto: str | None = None) -> Treatment:
    return Treatment(IMPLEMENTED, reason, auto=auto)


def noop(reason: str) -> Treatment:
    return Treatment(NO_OP, reason)


def warned(reason: str) -> Treatment:
    return Treatment(WARNED, reason)


def refused(reason: str, off: str = DISABLED) -> Treatment:
    return Treatment(REFUSED, reason, off=off)


def only(values: tuple[Any, ...], reason: str) -> Treatment:
    return Treatment(REFUSED, reason, accepts=values)


REMOVED = "removed from DeepSpeed 0.19.8 too (it refuses the key); kept here for configs from older versions"
SPEED = "a speed knob"
STAGE3_UNITS = ("stage 3 gathers one module's parameters at a time (its unit) as the module runs, with "
                "prefetch and live-parameter limits; there is no per-parameter or per-module fetch to tune")
NO_PIPELINE = "DeepSpeed reads it when loading pipeline checkpoints under ZeRO; shardwise checkpoints load by parameter name at any layout"
NO_MOE = "only used with expert parallelism, which shardwise refuses"
NO_DEEPCOMPILE = "configures DeepCompile passes; `compile.deepcompile` (refused) turns them on"

TABLE: dict[str, Treatment] = {
    # --- batch, steps, precision ------------------------------------------------------------------
    "train_batch_size": impl("train = micro × accumulation × data-parallel size; any two give the third", DERIVE),
    "train_micro_batch_size_per_gpu": impl("samples per rank per forward", DERIVE),
    "gradient_accumulation_steps": impl("micro-steps per optimizer step", DERIVE),
    "steps_per_print": impl("optimizer steps between progress reports; a float infinity (or null) never reports"),
    "gradient_clipping": impl("global-norm clip (DeepSpeed's default 1.0; 0 disables)"),
    "prescale_gradients": impl("divide gradients by the data-parallel size before reducing"),
    "gradient_predivide_factor": impl("divide by this before the reduce and by size/factor after"),
    "communication_data_type": impl("the dtype gradients are reduced in"),
    "wall_clock_breakdown": impl("forward/backward/step timers in the progress report"),
    "memory_breakdown": impl("per-step memory breakdown"),
    "dataloader_drop_last": impl("the loader `initialize` returns drops the last incomplete micro-batch"),
    "data_parallel_size": impl("checked against the data-parallel size (DeepSpeed reads it with sequence_parallel_size)"),
    "sequence_parallel_size": impl("Ulysses sequence parallelism: consecutive ranks share each sequence, attention exchanges heads for tokens (shardwise.sequence_parallel)"),
    "seq_parallel_communication_data_type": noop("Ulysses' all-to-alls exchange activations in their own dtype"),
    "gradient_allreduce_op": only(("mean",), "summing gradients over ranks instead of averaging"),
    "managed_gradient_accumulation": only((True,), "caller-managed accumulation boundaries; use gradient_accumulation_steps or set_gradient_accumulation_boundary()"),
    "fp16.*": impl("fp16 mixed precision with fp32 master weights and DeepSpeed's static/dynamic loss scaling"),
    "fp16.fp16_master_weights_and_grads": only((False,), "fp16 master weights (shardwise keeps fp32 masters)"),
    "bf16": impl("bf16 mixed precision (`bfloat16` is the older spelling)"),
    "bf16.enabled": impl("bf16 mixed precision with fp32 master weights (bf16 ones with `bf16_master_weights_and_grads`)"),
    "bf16.check_grad_overflow": only((True,), "shardwise never applies a step whose gradient norm is not finite, at any precision (`nonfinite_grads` chooses skip or raise); false would let nan/inf reach the weights (DeepSpeed's default is true, and its stage 3 skips such a step whatever the flag)"),
    "bf16.immediate_grad_update": noop("true and false train alike here: gradients accumulate in `data_types.grad_accum_dtype` (fp32 unless set), which is what true does; false in DeepSpeed accumulates in bf16, which is `data_types.grad_accum_dtype: \"bf16\"` here"),
    "bf16.bf16_master_weights_and_grads": impl("ZeRO 1-3: the optimizer steps the bf16 parameters from bf16 gradients, with no fp32 master copy; only together with `bf16_optimizer_states` (bf16 masters with fp32 state need DeepSpeedCPUAdam offload: refused), not with offload_optimizer; stage 0 is refused, as in DeepSpeed"),
    "bf16.bf16_optimizer_states": impl("ZeRO 1-3: optimizer state in bf16 (torch's optimizers keep it in the bf16 parameters' dtype); needs `bf16_master_weights_and_grads`, as in DeepSpeed"),
    "torch_autocast.*": impl("torch.autocast around the engine's forward; bfloat16 only (float16 needs a gradient scaler)"),
    "torch_autocast.lower_precision_safe_modules": impl("module classes are checked to import; their gradients are reduced in `communication_data_type` like all others (DeepSpeed reduces them in the autocast dtype)"),
    "data_types": impl("dtypes of gradient accumulation, parameters and buffers"),
    "data_types.grad_accum_dtype": impl("dtype gradients accumulate in across micro-steps (fp32 by default)"),
    "data_types.param_dtype": impl("checked against fp16/bf16.enabled, as DeepSpeed does"),
    "data_types.buffer_dtype": impl("accepted when it is the training dtype: buffers are cast with the model"),
    "data_types.keep_in_fp32_modules": only(("auto", []), "buffers named here stay fp32; shardwise casts every floating buffer with the model (DeepSpeed's \"auto\" keeps a model's `_keep_in_fp32_modules_strict` buffers in fp32, shardwise does not)"),
    "amp": refused(REMOVED),
    # --- optimizer and scheduler ----------------------------------------------------------------
    "optimizer": impl("built over the strategy's parameter groups; a section without `type` builds none, as in DeepSpeed"),
    "optimizer.type": impl("Adam, AdamW, SGD, Lamb, Lion, Adagrad, OneBitAdam, ZeroOneAdam, OneBitLamb (stage 0; "
                           "DeepSpeed 0.19.8 has dropped these three), or any torch.optim class name"),
    "optimizer.params": impl("checked against the optimizer's arguments at initialize"),
    "optimizer.legacy_fusion": noop("picked an apex fused-fp16 optimizer variant; the math is the same"),
    "scheduler.*": impl("WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, or any torch.optim.lr_scheduler class"),
    "zero_allow_untested_optimizer": noop("shardwise shards any torch optimizer; nothing to allow"),
    "zero_force_ds_cpu_optimizer": noop("shardwise steps any optimizer on offloaded masters; nothing to force"),
    # --- ZeRO -----------------------------------------------------------------------------------
    "zero_optimization": impl("`true`/`false` (DeepSpeed's oldest form) mean stage 1/0"),
    "zero_optimization.stage": impl("0-3"),
    "zero_optimization.reduce_bucket_size": impl("elements per gradient bucket (stages 0-2)", DEFAULT),
    "zero_optimization.allgather_bucket_size": noop("the all-gather runs per reduce bucket, so `reduce_bucket_size` bounds both", ),
    "zero_optimization.overlap_comm": impl("reduce gradient buckets while backward runs"),
    "zero_optimization.reduce_scatter": noop("always on: a reduce-scatter moves half the bytes of an all-reduce"),
    "zero_optimization.contiguous_gradients": noop("gradients always go into contiguous buckets"),
    "zero_optimization.allgather_partitions": noop("always one all-gather per bucket"),
    "zero_optimization.round_robin_gradients": noop("an ordering aid for DeepSpeed's CPU offload copies; shardwise overlaps them per sub-group"),
    "zero_optimization.use_multi_rank_bucket_allreduce": noop(SPEED + "; gradients are reduce-scattered per bucket"),
    "zero_optimization.elastic_checkpoint": noop("checkpoints are saved by parameter name and load at any world size"),
    "zero_optimization.load_from_fp32_weights": only((True,), "rebuilding fp32 masters from the 16-bit weights; shardwise loads the fp32 masters"),
    "zero_optimization.compute_grad_norm": noop("the global norm is always computed (it is one reduction)"),
    "zero_optimization.ignore_unused_parameters": noop("unused parameters are always handled (their gradient is zero)"),
    "zero_optimization.legacy_stage1": noop("an older implementation of the same stage 1"),
    "zero_optimization.parameter_alignment": noop("padding between parameters for aligned addresses; shardwise pads only at bucket ends"),
    "zero_optimization.sub_group_size": impl("elements per optimizer sub-group when offloading", DEFAULT),
    "zero_optimization.stage3_prefetch_bucket_size": impl("elements gathered ahead of use (stage 3)", DEFAULT),
    "zero_optimization.stage3_param_persistence_threshold": impl("modules with fewer elements stay whole on every rank (stage 3)", DEFAULT),
    "zero_optimization.stage3_max_live_parameters": impl("gathered elements kept live at most (stage 3)", DEFAULT),
    "zero_optimization.stage3_max_reuse_distance": impl("keep a gathered module if it is reused within this many elements (stage 3)", DEFAULT),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": impl("save_16bit_model() gathers the full weights at stage 3"),
    "zero_optimization.stage3_model_persistence_threshold": only((sys.maxsize,), "a cap on the total elements kept whole by the persistence threshold"),
    "zero_optimization.stage3_module_granularity_threshold": impl("modules with at most this many elements per layer are gathered whole, without hooks on their descendants (stage 3)", DEFAULT),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": noop(STAGE3_UNITS),
    "zero_optimization.stage3_allgather_sequential": noop(STAGE3_UNITS),
    "zero_optimization.memory_efficient_linear": noop("DeepSpeed's stage 3 swaps in its own F.linear; shardwise patches no torch function"),
    "zero_optimization.override_module_apply": noop("DeepSpeed's stage 3 patches Module.apply to gather first; shardwise patches no torch function (gather inside shardwise.zero.GatheredParameters)"),
    "zero_optimization.pipeline_loading_checkpoint": noop(NO_PIPELINE),
    "zero_optimization.log_trace_cache_warnings": noop("DeepSpeed's stage-3 trace cache, which shardwise does not have"),
    "zero_optimization.enable_sanity_checks": noop("DeepSpeed-internal debug checks"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": noop("only used with the Muon optimizer, which shardwise refuses"),
    "zero_optimization.leaf_module.*": noop("DeepSpeed's stage 3 fetches a leaf module (an MoE block) whole, without per-submodule hooks; shardwise's stage 3 handles submodules that do not run in a step (unused experts) without it"),
    "zero_optimization.zero_hpz_partition_size": impl("ZeRO++ hpZ: a secondary weight partition within a node serves the gathers after the forward's"),
    "zero_optimization.zero_quantized_weights": impl("ZeRO++ qwZ: int8 blockwise weight all-gathers"),
    "zero_optimization.zero_quantized_nontrainable_weights": only((False,), "ZeRO++ quantized frozen weights"),
    "zero_optimization.zero_quantized_gradients": impl("ZeRO++ qgZ: 4-bit blockwise gradient reduce-scatter (all-to-all)"),
    "zero_optimization.zenflow.*": refused("ZenFlow (selective, delayed gradient updates)"),
    "zero_optimization.mics_shard_size": refused(REMOVED),
    "zero_optimization.mics_hierarchical_params_gather": refused(REMOVED),
    "zero_optimization.zeropp_loco_param": refused(REMOVED),
    "zero_optimization.cpu_offload": impl("old spelling: true means offload_optimizer to the CPU"),
    "zero_optimization.cpu_offload_param": impl("old spelling: true means offload_param to the CPU"),
    "zero_optimization.cpu_offload_use_pin_memory": impl("old spelling: sets pin_memory of the offload sections that do not set it (DeepSpeed 0.19.8 only warns; its pin_memory defaults to true)"),
    "zero_optimization.offload_optimizer": impl("where fp32 master weights and optimizer state live"),
    "zero_optimization.offload_optimizer.device": impl("none, cpu or nvme (stages 1-3)"),
    "zero_optimization.offload_optimizer.nvme_path": impl("directory for the swap files"),
    "zero_optimization.offload_optimizer.pin_memory": impl("page-locked host buffers (CUDA)"),
    "zero_optimization.offload_optimizer.ratio": only((1.0,), "partial optimizer offload"),
    "zero_optimization.offload_optimizer.buffer_count": noop("NVMe offload keeps at most two sub-groups in memory (the one stepped and the next), each in buffers of its own size"),
    "zero_optimization.offload_optimizer.fast_init": noop("a faster first write of DeepSpeed's swap files; shardwise writes them once, when the optimizer is built"),
    "zero_optimization.offload_optimizer.pipeline_read": noop("the next sub-group is always read while the current one is stepped"),
    "zero_optimization.offload_optimizer.pipeline_write": noop("each stepped sub-group is always written back asynchronously"),
    "zero_optimization.offload_optimizer.super_offload": noop(SPEED + " for Grace-Hopper-class CPUs; the CPU step is the same math"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": noop("the CPU optimizer uses torch's threads (torch.set_num_threads)"),
    "zero_optimization.offload_param": impl("where stage 3's parameter slices live between uses"),
    "zero_optimization.offload_param.device": impl("none, cpu or nvme; ignored below stage 3 (noted once), as DeepSpeed does"),
    "zero_optimization.offload_param.nvme_path": impl("directory for the swap files"),
    "zero_optimization.offload_param.pin_memory": impl("page-locked host buffers (CUDA)"),
    "zero_optimization.offload_param.buffer_count": noop("an NVMe-offloaded slice is read into a buffer of its own size each time it is gathered"),
    "zero_optimization.offload_param.buffer_size": noop("an NVMe-offloaded slice is read into a buffer of its own size each time it is gathered"),
    "zero_optimization.offload_param.max_in_cpu": noop("NVMe-offloaded slices are read from their swap files each time they are gathered; none are cached in host memory"),
    "allgather_size": noop("all-gather size of the `zero_optimization: true` form; see zero_optimization.allgather_bucket_size"),
    # --- checkpoints, I/O -----------------------------------------------------------------------
    "checkpoint": impl("how checkpoints are saved and checked"),
    "checkpoint.tag_validation": impl("Ignore, Warn or Fail when ranks save under different tags (any case)"),
    "checkpoint.use_node_local_storage": noop("every rank already writes only its own file"),
    "checkpoint.load_universal": noop("shardwise checkpoints already load at any world size and stage, which is what universal checkpoints are for; they are read in shardwise's own format"),
    "checkpoint.checkpoint_serialization": noop("checkpoints are safetensors files, not torch.save zip files"),
    "checkpoint.parallel_write.*": noop("every rank, of every pipeline stage, already writes its own file in parallel"),
    "checkpoint.writer.*": noop("DeepSpeed's fast-writer I/O tuning; shardwise writes safetensors (checkpoint.async_save writes in the background)"),
    "datastates_ckpt": noop("the DataStates asynchronous checkpoint engine; checkpoint.async_save does background saves here"),
    "nebula": refused(REMOVED),
    "aio.*": impl("the asynchronous I/O of NVMe offload"),
    "aio.use_gds": noop("GPUDirect Storage; NVMe offload reads through host memory"),
    # --- seeing the run ---------------------------------------------------------------------------
    "tensorboard.*": impl("TensorBoard event files"),
    "csv_monitor.*": impl("CSV files"),
    "wandb.*": impl("Weights & Biases (needs the wandb package)"),
    "comet.*": warned("shardwise has no Comet monitor; use tensorboard, csv_monitor or wandb"),
    "flops_profiler.*": impl("profile one step and print the module tree"),
    "comms_logger.*": impl("the collectives table"),
    "timers.*": noop("throughput is in shardwise's progress report (samples/s, tokens/s) at every steps_per_print"),
    "dump_state": warned("prints DeepSpeed's engine state at start-up; shardwise has no such dump"),
    "log_level": warned("set shardwise's log level with logging.getLogger(\"shardwise\").setLevel"),
    "vocabulary_size": noop("DeepSpeed only warns when it is not a multiple of 8"),
    "disable_allgather": noop("read by DeepSpeed 0.19.8 but used nowhere"),
    "disable_python_gc": noop(SPEED + " (Python's cyclic collector paused during training)"),
    "autotuning.*": impl("`shardwise autotune` / `--autotuning tune|run`: the search, and each experiment's report"),
    # --- activation checkpointing -----------------------------------------------------------------
    "activation_checkpointing.*": impl("how shardwise.runtime.activation_checkpointing.checkpoint recomputes"),
    # --- pipeline parallelism (a PipelineModule) -------------------------------------------------------
    "pipeline.*": impl("how a PipelineModule trains: train_batch / eval_batch"),
    "pipeline.stages": impl("checked against the PipelineModule's num_stages (\"auto\": whatever it has)", DEFAULT),
    "pipeline.use_reentrant": noop("the PipelineModule's activation checkpointing is non-reentrant whatever the value; the gradients are the same"),
    "pipeline.partition": noop("the PipelineModule's partition_method decides how layers split"),
    "pipeline.seed_layers": noop("the PipelineModule's seed_layers argument decides"),
    "pipeline.activation_checkpoint_interval": noop("the PipelineModule's activation_checkpoint_interval argument decides"),
    "pipeline.pipe_partitioned": noop("splits activations sent between stages across tensor-parallel ranks; every tensor-parallel rank of a stage sends its whole activation"),
    "pipeline.grad_partitioned": noop("splits gradients sent between stages across tensor-parallel ranks; every tensor-parallel rank of a stage sends its whole gradient"),
    # --- tensor parallelism (AutoTP) -------------------------------------------------------------------
    "tensor_parallel.*": impl("AutoTP training: the model's layers are split over autotp_size ranks at initialize"),
    "tensor_parallel.tp_overlap_comm": noop("the row-parallel all-reduces run in line; backward overlaps the data-parallel reduction"),
    "tensor_parallel.vocab_parallel_ce_backend": noop("the model's own loss runs on gathered logits; shardwise.tensor_parallel.vocab_parallel_cross_entropy is the torch reference"),
    "tensor_parallel.dtype": noop("the model's dtype follows fp16/bf16.enabled"),
    "tensor_parallel.keep_module_on_host": noop("checkpoints are read slice by slice into the split parameters"),
    "tensor_parallel.tensor_parallel.*": noop("inference settings (tp_size, tp_grain_size); training uses autotp_size"),
    "tensor_parallel.injection_policy_tuple": refused("inference kernel-injection policies"),
    "tensor_parallel.replace_with_kernel_inject": only((False,), "inference kernel injection"),
    # --- data efficiency (shardwise.data_efficiency) ----------------------------------------------------
    "curriculum_learning.*": impl("sequence-length curriculum: the engine trains on the first `difficulty` positions "
                                  "of each batch (DeepSpeed 0.19.8 removed this section; kept for older configs)"),
    "data_efficiency.*": impl("curriculum learning by analysed data difficulty (data_sampling) and random-LTD "
                              "(data_routing)"),
    "data_efficiency.data_sampling.pin_memory": noop("batches are moved to the device by the engine's loader"),
    # --- sparse attention (removed from DeepSpeed 0.19.8; shardwise keeps it, on flex_attention) -------------
    "sparse_attention.*": impl("block-sparse attention (modes dense, fixed, variable, bigbird, bslongformer): initialize "
                               "switches a Hugging Face model's attention to shardwise.sparse_attention"),
    # --- features shardwise does not have -------------------------------------------------------------
    "expert_parallel.*": refused("AutoEP expert parallelism", UNLESS_ENABLED),
    "use_data_before_expert_parallelism": noop(NO_MOE),
    "hybrid_engine.*": refused("the RLHF hybrid training/inference engine", UNLESS_ENABLED),
    "data_efficiency.data_sampling.dynamic_batching.*": refused("dynamic batching (variable batch size and lr)", UNLESS_ENABLED),
    "weight_quantization.*": refused("quantized weight initialization"),
    "compile.deepcompile": only((False,), "DeepCompile"),
    "compile.*": noop(NO_DEEPCOMPILE),
    "compression_training": refused(REMOVED),
    "eigenvalue": refused(REMOVED),
    "elasticity": refused(REMOVED),
    "graph_harvesting": refused(REMOVED),
    "progressive_layer_drop": refused(REMOVED),
    "quantize_training": refused(REMOVED),
    "sparse_gradients": refused(REMOVED),
}

# DeepSpeed's other spellings -> shardwise's (both accepted; giving two spellings of one key with
# different values is an error).
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "zero_optimization_stage": "zero_optimization.stage",
    "zero_optimization.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.gather_16bit_weights_on_model_save": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.model_persistence_threshold": "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.module_granularity_threshold": "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.use_all_reduce_for_fetch_params": "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    "zero_optimization.allgather_sequential": "zero_optimization.stage3_allgather_sequential",
    "aio.intra_op_parallelism": "aio.thread_count",
    "tensor_parallel.tp": "tensor_parallel.tensor_parallel",
    "tensor_parallel.kernel_inject": "tensor_parallel.replace_with_kernel_inject",
}


def canonical(path: str) -> str:
    """`path` with a DeepSpeed alias (of the path or one of its sections) replaced by shardwise's spelling."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in ALIASES:
            return ".".join([ALIASES[head], *parts[i:]])
    return path


def lookup(path: str) -> Treatment | None:
    """The treatment of a dotted key path: its own entry, else the nearest `section.*` above it."""
    path = canonical(path)
    if path in TABLE:
        return TABLE[path]
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        entry = TABLE.get(".".join(parts[:i]) + ".*")
        if entry is not None:
            return entry
    return None


def is_switched_off(value: object, off: str = DISABLED) -> bool:
    """True for a section that asks for nothing (see the module docstring)."""
    if off == UNLESS_ENABLED:
        return not _enables_something(value)
    if off == UNLESS_AUTOTP:  # DeepSpeed trains with AutoTP only when autotp_size > 0
        size = value.get("autotp_size", 0) if isinstance(value, dict) else 0
        return isinstance(size, (int, float)) and not isinstance(size, bool) and size <= 0
    if value is False or value is None:
        return True
    if isinstance(value, dict):
        if value.get("enabled") is False:
            return True
        device = value.get("device")
        return device is not None and str(device).lower() == "none"
    return False


def _enables_something(value: object) -> bool:
    if value is True:
        return True
    if isinstance(value, dict):
        return value.get("enabled") is True or any(_enables_something(v) for v in value.values() if isinstance(v, dict))
    return False


def accepted_value(treatment: Treatment, value: Any) -> bool:
    """A value a limited key accepts (1 and 1.0 alike; a bool never stands for a number)."""
    assert treatment.accepts is not None
    return any(_same_kind(value, a) and value == a for a in treatment.accepts)


def _same_kind(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    numbers = (int, float)
    return (isinstance(a, numbers) and isinstance(b, numbers)) or type(a) is type(b)
