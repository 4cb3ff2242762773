"""Every DeepSpeed name that the scripts people run import (transformers' and accelerate's integrations, peft,
DeepSpeed-Chat, DeepSpeedExamples) resolves in the compatibility package, to shardwise's implementation."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

import shardwise

NAMES = {  # module: names imported from it by real scripts
    "deepspeed": ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "DeepSpeedConfig",
                  "get_accelerator", "zero", "comm", "ops", "checkpointing", "OnDevice", "PipelineModule",
                  "init_inference", "InferenceEngine", "tp_model_init", "log_dist", "logger", "module_inject", "__version__"],
    "deepspeed.comm": ["get_rank", "get_world_size", "get_local_rank", "barrier", "all_reduce", "broadcast",
                       "all_gather", "is_initialized", "init_distributed", "ReduceOp", "new_group"],
    "deepspeed.accelerator": ["get_accelerator"],
    "deepspeed.ops.adam": ["DeepSpeedCPUAdam", "FusedAdam"],
    "deepspeed.ops.adagrad": ["DeepSpeedCPUAdagrad"],
    "deepspeed.ops.lamb": ["FusedLamb"],
    "deepspeed.ops.lion": ["DeepSpeedCPULion", "FusedLion"],
    "deepspeed.ops.sparse_attention": ["SparseSelfAttention", "FixedSparsityConfig", "SparseAttentionUtils",
                                       "BertSparseSelfAttention", "SparsityConfig", "DenseSparsityConfig",
                                       "VariableSparsityConfig", "BigBirdSparsityConfig", "BSLongformerSparsityConfig",
                                       "LocalSlidingWindowSparsityConfig"],
    "deepspeed.ops.sparse_attention.sparsity_config": ["FixedSparsityConfig", "BigBirdSparsityConfig"],
    "deepspeed.ops.sparse_attention.sparse_self_attention": ["SparseSelfAttention"],
    "deepspeed.ops.sparse_attention.sparse_attention_utils": ["SparseAttentionUtils"],
    "deepspeed.ops.sparse_attention.bert_sparse_self_attn": ["BertSparseSelfAttention"],
    "deepspeed.zero": ["Init", "GatheredParameters", "register_external_parameter"],
    "deepspeed.runtime.zero": ["Init", "GatheredParameters", "ZeroParamStatus"],
    "deepspeed.runtime.zero.partition_parameters": ["ZeroParamStatus", "GatheredParameters", "Init",
                                                     "zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange",
                                                     "get_accelerator"],
    "deepspeed.runtime.zero.stage3": ["estimate_zero3_model_states_mem_needs_all_live",
                                      "estimate_zero3_model_states_mem_needs_all_cold"],
    "deepspeed.runtime.zero.stage_1_and_2": ["estimate_zero2_model_states_mem_needs_all_live",
                                             "estimate_zero2_model_states_mem_needs_all_cold"],
    "deepspeed.runtime.engine": ["DeepSpeedEngine"],
    "deepspeed.runtime.lr_schedules": ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                       "OneCycle", "LRRangeTest"],
    "deepspeed.runtime.utils": ["see_memory_usage", "move_to_device"],
    "deepspeed.runtime.dataloader": ["RepeatingLoader"],
    "deepspeed.checkpointing": ["checkpoint", "configure", "is_configured", "reset"],
    "deepspeed.checkpoint.utils": ["clone_tensors_for_torch_save"],
    "deepspeed.utils": ["logger", "log_dist", "set_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
                        "safe_get_full_fp32_param", "safe_get_full_optimizer_state", "safe_get_full_grad",
                        "safe_set_full_fp32_param"],
    "deepspeed.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint",
                                     "convert_zero_checkpoint_to_fp32_state_dict"],
    "deepspeed.moe.layer": ["MoE"],
    "deepspeed.moe.utils": ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"],
    "deepspeed.compression.helper": ["recursive_getattr", "recursive_setattr"],
    "deepspeed.runtime.data_pipeline.data_routing.helper": ["convert_to_random_ltd", "remove_random_ltd_state_dict",
                                                            "save_without_random_ltd"],
    "deepspeed.runtime.data_pipeline.data_routing.scheduler": ["RandomLTDScheduler"],
    "deepspeed.launcher.runner": ["main", "DEEPSPEED_ENVIRONMENT_NAME"],
    "deepspeed.pipe": ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipeDataParallelTopology"],
    "deepspeed.runtime.pipe.module": ["PipelineModule", "LayerSpec", "TiedLayerSpec"],
    "deepspeed.runtime.pipe.topology": ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
                                        "PipelineParallelGrid"],
    "deepspeed.runtime.pipe.engine": ["PipelineEngine"],
    "deepspeed.runtime.tensor_parallel": ["tp_model_init"],
    "deepspeed.module_inject.layers": ["set_autotp_mode"],
    "deepspeed.utils.groups": ["get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
                               "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_src_rank",
                               "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
                               "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size"],
}


@pytest.mark.parametrize("module", list(NAMES))
def test_names_resolve(module):
    mod = importlib.import_module(module)
    missing = [name for name in NAMES[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lacks {missing}"


def test_names_are_shardwises():
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert deepspeed.initialize is shardwise.initialize and deepspeed.zero.Init is shardwise.zero.Init
    assert deepspeed.DeepSpeedEngine is shardwise.Engine and DeepSpeedCPUAdam is shardwise.optim.adam.CPUAdam
    assert deepspeed.get_accelerator() is shardwise.accelerator.get_accelerator()
    assert ZeroParamStatus is shardwise.zero.ZeroParamStatus
    assert deepspeed.tp_model_init is shardwise.tp_model_init
    assert deepspeed.__version__ == importlib.metadata.version("deepspeed") == "0.19.8+shardwise"


def test_hugging_face_and_accelerate_see_deepspeed():
    from accelerate.utils import compare_versions, is_deepspeed_available
    from transformers.integrations import is_deepspeed_available as hf_available

    assert hf_available() and is_deepspeed_available()
    assert compare_versions("deepspeed", ">=", "0.16.4")  # accelerate's gate for DeepSpeed TP paths


def test_unsupported_features_say_so():
    from deepspeed.moe.layer import MoE

    with pytest.raises(NotImplementedError, match="not supported by shardwise yet"):
        MoE(hidden_size=8)


def test_init_inference_is_shardwises():
    import deepspeed

    from shardwise.inference import InferenceEngine

    assert deepspeed.InferenceEngine is InferenceEngine
    model = torch.nn.Linear(4, 3)
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": 1}, dtype=torch.float32)
    assert isinstance(engine, deepspeed.InferenceEngine) and engine.module is model
    x = torch.randn(2, 4)
    assert torch.equal(engine(x), model(x).detach())


def test_tp_model_init_records_the_size_that_initialize_splits_with():
    import deepspeed
    from deepspeed.module_inject.layers import set_autotp_mode

    from shardwise.tensor_parallel.megatron import recorded_init

    set_autotp_mode(training=True)  # DeepSpeed scripts call it first; nothing to switch here
    model = torch.nn.Linear(2, 2)
    # transformers' deepspeed_init calls it so (integrations/deepspeed.py)
    assert deepspeed.tp_model_init(model=model, tp_size=2, dtype=torch.float32, config={}) is model
    assert recorded_init(model) == {"tp_size": 2, "dtype": torch.float32}
    with pytest.raises(ValueError, match=r"tp_model_init: tp_size must be a positive integer; got 0\."):
        deepspeed.tp_model_init(model, tp_size=0, dtype=torch.float32)
    # before initialize (a fresh process), the groups' getters say what to do
    code = "from deepspeed.utils import groups; groups.get_data_parallel_rank()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stderr.strip().endswith(
        "GroupsNotReadyError: deepspeed.utils.groups.get_data_parallel_rank(): the process groups are built by "
        "initialize(); call it after deepspeed.initialize / shardwise.initialize."), done.stderr


def test_another_deepspeed_on_the_path_is_reported(tmp_path):
    other = tmp_path / "deepspeed"
    other.mkdir()
    (other / "__init__.py").write_text("")
    import deepspeed

    ours = os.path.dirname(os.path.dirname(deepspeed.__file__))
    # ours first on the path (as an installed package in site-packages), the other one later: it is shadowed
    code = f"import sys; sys.path[:0] = [{ours!r}]; sys.path.append({str(tmp_path)!r}); import deepspeed"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "another DeepSpeed is installed too" in done.stderr and str(other) in done.stderr


def test_deepspeed_and_ds_report_commands():
    bin_dir = os.path.dirname(sys.executable)
    done = subprocess.run([os.path.join(bin_dir, "deepspeed"), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: deepspeed")
    done = subprocess.run([os.path.join(bin_dir, "ds_report"), "--hide_operator_status"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "shardwise" in done.stdout


def test_the_deepspeed_command_starts_ranks_without_importing_torch():
    """A launcher process only starts ranks: importing the `deepspeed` package (torch and the engine, ~2 CPU-s per
    launch) would be paid by every `deepspeed train.py` for nothing. The installed script, as a user runs it."""
    for name in ("deepspeed", "ds"):
        script = os.path.join(os.path.dirname(sys.executable), name)
        done = subprocess.run([sys.executable, "-X", "importtime", script, "--help"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and done.stdout.startswith("usage: deepspeed")
        imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
        assert "shardwise.launcher.cli" in imported, done.stderr[-2000:]  # not vacuous: the import log is there
        assert not {"torch", "deepspeed"} & imported, sorted({"torch", "deepspeed"} & imported)
