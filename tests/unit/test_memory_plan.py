"""The planner's arithmetic (planner/plan.py) and `shardwise plan`; the check against measured peaks is
tests/distributed/test_memory_planner.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.planner import ActivationProfile, ModelShape, plan
from shardwise.zero import set_z3_leaf_modules
from shardwise.zero.stage3.leaf import set_leaves_by_granularity

REPO = Path(__file__).resolve().parents[2]
SHAPE = ModelShape(trainable=1_000_000, module_sizes=(400_000, 300_000, 200_000, 50_000, 50_000))


def _cfg(stage: int, **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage, **zero}}


def test_model_states_follow_the_zero_formula_per_stage() -> None:
    got = {stage: plan(SHAPE, _cfg(stage), 4) for stage in range(4)}
    # fp32, Adam: 4 bytes of parameter, 4 of gradient, 8 of state per element.
    assert [got[s].part("optimizer_state").device for s in range(4)] == [8_000_000, 2_000_000, 2_000_000, 2_000_000]
    assert [got[s].part("gradients").device for s in range(4)] == [4_000_000, 4_000_000, 1_000_000, 1_000_000]
    # Stage 3 keeps units under the persistence threshold (100k: the two 50k units) whole.
    assert got[3].part("parameters").device == 4 * 900_000 // 4
    assert got[3].part("persistent_parameters").device == 4 * 100_000


def test_offload_moves_masters_and_state_to_host_or_disk() -> None:
    cpu = plan(SHAPE, _cfg(2, offload_optimizer={"device": "cpu"}), 2)
    assert cpu.part("optimizer_state").host == 4_000_000 and cpu.part("optimizer_state").device == 0
    assert cpu.part("master_weights").host == 2_000_000  # the fp32 copy the host optimizer steps
    nvme = plan(SHAPE, _cfg(3, offload_optimizer={"device": "nvme", "nvme_path": "/tmp"},
                            offload_param={"device": "nvme", "nvme_path": "/tmp"}), 2)
    assert nvme.part("optimizer_state").disk == 4_000_000 and nvme.part("parameters").disk == 4 * 900_000 // 2
    assert nvme.peak_host == 0


def test_sixteen_bit_parameters_add_fp32_masters_and_halve_activations() -> None:
    acts = ActivationProfile(saved_bytes=1_000_000, micro_batch=1, compute_bytes=4)
    fp32 = plan(SHAPE, _cfg(1), 2, acts)
    bf16 = plan(SHAPE, {**_cfg(1), "bf16": {"enabled": True}}, 2, acts)
    assert bf16.part("parameters").device == fp32.part("parameters").device // 2
    assert bf16.part("master_weights").device == 4 * 1_000_000 // 2
    assert fp32.part("activations").device == 2_000_000 and bf16.part("activations").device == 1_000_000
    assert bf16.part("gradients").device == fp32.part("gradients").device  # accumulated in fp32 by default


def test_stage3_window_follows_reuse_distance_and_prefetch() -> None:
    wide = plan(SHAPE, _cfg(3), 2).part("zero3_window").device
    tight = plan(SHAPE, _cfg(3, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0), 2).part("zero3_window")
    assert wide == 4 * 900_000  # every non-persistent unit stays gathered from forward into backward
    assert tight.device == 4 * 400_000  # only the running (largest) unit


def test_stage3_window_counts_a_leaf_modules_units_as_gathered_at_once() -> None:
    """A ZeRO-3 leaf (an MoE block marked by class, or chosen by stage3_module_granularity_threshold) gathers its
    whole subtree when it runs: the running "unit" is the leaf's, persistent modules inside it aside."""
    tight = _cfg(3, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    with_leaf = ModelShape(trainable=1_000_000, module_sizes=SHAPE.module_sizes,
                           leaf_groups=((300_000, 200_000, 50_000),))
    assert plan(with_leaf, tight, 2).part("zero3_window").device == 4 * 500_000
    assert ModelShape.from_json(with_leaf.to_json()) == with_leaf

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 8)))
    assert ModelShape.of(model).leaf_groups == ()
    set_z3_leaf_modules(model, [torch.nn.Sequential])  # the root and its inner Sequential: the root is outermost
    assert ModelShape.of(model).leaf_groups == ((72, 36, 40),)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)  # 288 + 264 elements, granularity 184


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(500))  # the largest unit, smaller than a block's 552
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])  # a container: never a leaf


def test_stage3_window_knows_the_leaves_a_granularity_threshold_will_mark() -> None:
    """A plan is made before initialize: the leaves stage3_module_granularity_threshold will mark count as the
    engine's marks do (set_leaves_by_granularity, what the engine runs, marks a copy here)."""
    zero = dict(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0, stage3_param_persistence_threshold=0)
    shape = ModelShape.of(_Net())
    assert ModelShape.from_json(shape.to_json()) == shape
    marked = _Net()
    assert set_leaves_by_granularity(marked, 200)[0] == list(marked.blocks)  # the root's granularity is 1676 / 8

    def window(model_shape: ModelShape, threshold: int) -> int:
        config = _cfg(3, stage3_module_granularity_threshold=threshold, **zero)
        return plan(model_shape, config, 2).part("zero3_window").device

    assert window(shape, 0) == 4 * 500  # no leaves: the largest unit runs alone
    assert window(shape, 200) == window(ModelShape.of(marked), 0) == 4 * 552  # a block's two units at once
    assert window(shape, 100) == 4 * 500  # below every granularity: nothing marked


def test_stage2_staging_is_bounded_by_the_buckets_in_flight() -> None:
    small = plan(SHAPE, _cfg(2, reduce_bucket_size=100_000), 2).part("gradient_staging").device
    assert small == 4 * 3 * 100_000
    assert plan(SHAPE, _cfg(2), 2).part("gradient_staging").device == 4 * 1_000_000


def test_plan_command_prints_the_table_and_json(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**_cfg(3), "bf16": {"enabled": True}}))
    args = [sys.executable, "-m", "shardwise.cli", "plan", "--model", "examples.demo.model:from_preset",
            "--model_arg", "name=demo", "--model_arg", "n_layer=2", "--config", str(config), "--world", "2"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "zero3 window" in out.stdout and "peak per rank" in out.stdout and "traced on the CPU" in out.stdout
    data = json.loads(subprocess.run([*args, "--json"], cwd=REPO, capture_output=True, text=True, timeout=120).stdout)
    assert data["world"] == 2 and data["peak_device"] == sum(p["device"] for p in data["parts"].values())


def test_plan_command_refuses_a_model_it_cannot_name(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_cfg(0)))
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--model", "gpt2", "--config",
                          str(config)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "package.module:factory" in out.stderr


def test_plan_of_a_hugging_face_config_traces_its_model(tmp_path: Path) -> None:
    """The bundled tiny LLaMA config: shape from the config, activations from a traced forward with labels."""
    from shardwise.planner.models import profile

    tiny = REPO / "examples" / "finetune_llm" / "tiny_llama"
    shape, acts, how = profile(str(tiny), {}, 64)
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny))
    assert shape.trainable == sum(p.numel() for p in model.parameters())
    assert acts.seq_len == 64 and acts.saved_bytes > 0 and how == "traced on the CPU"
    longer = profile(str(tiny), {}, 128)[1]
    assert 1.8 < longer.saved_bytes / acts.saved_bytes < 2.2  # linear in the sequence, as scaled() assumes


def test_meta_trace_counts_what_a_real_trace_counts_but_attention(tmp_path: Path) -> None:
    """On the meta device there are no storages: views are counted once through their base, parameters not."""
    import torch

    from examples.demo.model import from_preset
    from shardwise.planner import ActivationProfile

    kw = dict(n_layer=2, d_model=64, n_head=2, seq_len=32)
    torch.manual_seed(0)
    real_model = from_preset("demo", **kw)
    x = torch.zeros(2, 32, dtype=torch.long)
    real = ActivationProfile.trace(lambda: real_model(x, x), real_model, 2, 32).saved_bytes
    with torch.device("meta"):
        meta_model = from_preset("demo", **kw)
        xm = torch.zeros(2, 32, dtype=torch.long)
    meta = ActivationProfile.trace(lambda: meta_model(xm, xm), meta_model, 2, 32).saved_bytes
    attention_weights = 2 * 2 * 2 * 32 * 32 * 4  # layers x batch x heads x S x S fp32: SDPA's math kernel
    logsumexp = 2 * 2 * 2 * 32 * 4  # what the flash kernel saves instead
    assert meta - real == attention_weights - logsumexp


def test_deepspeeds_estimators_print_the_planners_parts(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs_all_cold` names, answered from plan(): the GPU column
    is the plan's device peak for each offload option (model states, staging, window; no activations)."""
    from shardwise.planner.estimates import (estimate_zero2_model_states_mem_needs_all_live,
                                             estimate_zero3_model_states_mem_needs_all_cold)

    estimate_zero3_model_states_mem_needs_all_cold(7_000_000_000, 130_000_000, num_gpus_per_node=8)
    rows = [line for line in capsys.readouterr().out.splitlines() if "offload_param" in line]
    assert len(rows) == 6
    gpu = {row.split("|")[2].strip(): float(row.split("|")[1].strip()[:-2]) for row in rows}
    assert gpu["offload_param=none, offload_optimizer=none, zero_init=1"] > \
        gpu["offload_param=none, offload_optimizer=cpu , zero_init=1"] > \
        gpu["offload_param=cpu , offload_optimizer=cpu , zero_init=1"]
    none = plan(ModelShape(7_000_000_000, module_sizes=(130_000_000,) * 53 + (110_000_000,)),
                {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, 8)
    assert gpu["offload_param=none, offload_optimizer=none, zero_init=1"] == round(none.peak_device / 2**30, 2)
    estimate_zero2_model_states_mem_needs_all_live(torch_model(), num_gpus_per_node=2)
    assert "offload_optimizer=cpu" in capsys.readouterr().out


def torch_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
