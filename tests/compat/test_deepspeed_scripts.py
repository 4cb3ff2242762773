"""Scripts written for DeepSpeed the way DeepSpeed-Chat's step-1 SFT and DeepSpeedExamples' CIFAR-10 tutorial are
written (tests/compat/scripts: chat_sft.py, cifar_style.py), on two processes (four for ZeRO++'s hpZ). Without
the real DeepSpeed, ZeRO-3 (with LoRA, CPU offload and gradient checkpointing) must train as stage 0 does and save
whole weights; with it (`make test-deepspeed`), every run must match DeepSpeed's losses and saved weights.

Each script runs once under the compatibility package's `deepspeed` command, as its users launch it; its other
runs get torchrun's environment in a fork of a pre-imported interpreter (run.py), as DeepSpeed's runs do, since a
second fresh launch costs ~10 s of imports per rank and proves nothing the first did not."""

from __future__ import annotations

import pytest
import torch

from tests.compat.run import deepspeed_python, run_script
from tests.parity import oracle_step

RTOL = 1e-5
CHAT_ZERO3 = ["--zero_stage", "3", "--lora_dim", "4", "--offload", "--gradient_checkpointing"]
needs_deepspeed = pytest.mark.skipif(deepspeed_python() is None, reason="needs the real DeepSpeed: "
                                     "SHARDWISE_DEEPSPEED_PYTHON (set by `make test-deepspeed`, which .ci/run runs)")


def _chat(tmp_path, name: str, *flags: str, python: str | None = None, world: int = 2,
          launcher: str = "torchrun") -> tuple[dict, dict]:
    out = tmp_path / name
    kwargs = {"python": python, "timeout": 600} if python else {"launcher": launcher}
    result = run_script("chat_sft.py", "--model", str(tmp_path / "base"), "--output_dir", str(out), *flags,
                        world=world, **kwargs)
    return result, torch.load(out / "pytorch_model.bin", weights_only=True)


def _assert_same_training(ours: tuple[dict, dict], theirs: tuple[dict, dict]) -> None:
    """The same losses, parameter count and saved whole weights as the real DeepSpeed's run."""
    (result, weights), (their_result, their_weights) = ours, theirs
    assert result["losses"] == pytest.approx(their_result["losses"], rel=RTOL)
    assert result["params"] == their_result["params"] and set(weights) == set(their_weights)
    for key, value in their_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=RTOL, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_chat_sft_zero3_lora_offload_trains_like_stage0(tmp_path):
    stage0, weights0 = _chat(tmp_path, "zero0", "--zero_stage", "0", "--lora_dim", "4")
    zero3, weights3 = _chat(tmp_path, "zero3", *CHAT_ZERO3, launcher="deepspeed")
    assert zero3["losses"] == pytest.approx(stage0["losses"], rel=RTOL)
    assert zero3["params"] == stage0["params"] and zero3["epochs"] == 1
    assert set(weights3) == set(weights0) and all(v.numel() > 0 for v in weights3.values())
    for key, value in weights0.items():  # the frozen base, gathered whole by DeepSpeed-Chat's save sequence
        torch.testing.assert_close(weights3[key], value, msg=lambda m: f"{key}: {m}")


def test_cifar_style_zero3_with_moe_param_groups_trains_like_stage0():
    stage0 = run_script("cifar_style.py", "--stage", "0", "--deepspeed", world=2)
    zero3 = run_script("cifar_style.py", "--stage", "3", "--moe-param-group", "--deepspeed", world=2,
                       launcher="deepspeed")
    assert len(stage0["losses"]) == 6 and stage0["steps"] == zero3["steps"] == 6
    assert zero3["losses"] == pytest.approx(stage0["losses"], rel=RTOL)


@pytest.mark.deepspeed_parity
@needs_deepspeed
@pytest.mark.parametrize("flags", [CHAT_ZERO3, ["--zero_stage", "2"]], ids=["zero3-lora-offload-gc", "zero2"])
def test_chat_sft_matches_deepspeed(tmp_path, flags):
    _assert_same_training(_chat(tmp_path, "ours", *flags), _chat(tmp_path, "theirs", *flags, python=deepspeed_python()))


CHAT_HPZ = [*CHAT_ZERO3, "--persistence_threshold", "0", "--hpz", "2", "--ranks_per_node", "2"]


@pytest.mark.deepspeed_parity
@needs_deepspeed
def test_chat_sft_hpz_on_two_nodes_matches_deepspeed(tmp_path):
    """ZeRO++'s hpZ (zero_hpz_partition_size 2) at world 4, as 2 simulated nodes of 2 ranks, under the LoRA,
    offload and checkpointing set-up with no persistent parameter: exact, so the same losses and whole weights.
    DeepSpeed groups its secondary partitions by consecutive ranks ([0, 1], [2, 3]) whatever its node count; the
    script's --ranks_per_node 2 puts shardwise's nodes (SHARDWISE_NODE) on the same ranks, so both libraries form
    the same partitions (shardwise's frozen base weights are partitioned within each node, which is exact too).
    Both must really use them: DeepSpeed's parameters hold secondary tensors after a backward, shardwise's
    secondary group serves gathers.

    qwZ and qgZ are not compared: DeepSpeed 0.19.8 has no CPU kernel for them (its QuantizerBuilder is
    not implemented on CPU: zero_quantized_weights fails in zero.Init, zero_quantized_gradients at the first
    gradient reduction across nodes, and on one node it falls back to the exact reduce-scatter)."""
    ours = _chat(tmp_path, "ours", *CHAT_HPZ, world=4)
    theirs = _chat(tmp_path, "theirs", *CHAT_HPZ, python=deepspeed_python(), world=4)
    assert ours[0]["secondary"] > 0 and theirs[0]["secondary"] > 0
    _assert_same_training(ours, theirs)


@pytest.mark.deepspeed_parity
@needs_deepspeed
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cifar_style_matches_deepspeed(stage):
    flags = ["--stage", str(stage), "--deepspeed"]
    theirs = run_script("cifar_style.py", *flags, world=2, python=deepspeed_python())
    ours = run_script("cifar_style.py", *flags, world=2)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=RTOL) and ours["lr"] == pytest.approx(theirs["lr"])


def test_pipeline_style_trains_under_the_deepspeed_command():
    """DeepSpeedExamples' pipeline pattern (PipelineModule + train_batch from the engine's loader) at 2 stages:
    ZeRO-0 and ZeRO-1 train alike, clipping included."""
    zero0 = run_script("pipeline_style.py", "--zero_stage", "0", world=2)
    zero1 = run_script("pipeline_style.py", "--zero_stage", "1", world=2, launcher="deepspeed")
    assert zero0["steps"] == zero1["steps"] == 6 and zero0["micro_batches"] == 8 and zero0["parts"] == [0, 4, 7]
    assert zero1["losses"] == pytest.approx(zero0["losses"], rel=RTOL)
    assert zero0["losses"][-1] < zero0["losses"][0]


@pytest.mark.deepspeed_parity
@needs_deepspeed
@pytest.mark.parametrize("zero,clip", [("0", "0"), ("1", "0.5")])
def test_pipeline_style_matches_deepspeed(zero, clip):
    """The same losses as DeepSpeed's PipelineEngine. Not at ZeRO-0 with clipping: DeepSpeed 0.19.8's pipeline
    engine clips every stage by the first stage's gradient norm alone (20.2 where the whole model's is 27.75 in
    DeepSpeedExamples' pipeline example; here below 0.5, so its losses with 0.5 equal those with 0); shardwise clips
    by the norm over every stage, as the single-process oracle does (tests/distributed/test_pipeline.py)."""
    flags = ["--zero_stage", zero, "--clip", clip]
    theirs = run_script("pipeline_style.py", *flags, world=2, python=deepspeed_python(), timeout=600)
    ours = run_script("pipeline_style.py", *flags, world=2)
    assert ours["parts"] == theirs["parts"] and ours["micro_batches"] == theirs["micro_batches"]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=RTOL)


def _autotp_oracle(steps: int = 3, clip: float = 0.5) -> list[float]:
    """The single-process loop autotp_llama.py's model and batches describe (clipping acts: the norm is ~1.36)."""
    from tests.compat.scripts.autotp_llama import BATCH, SEQ, VOCAB, build

    model = build(tie=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        losses.append(oracle_step(model, opt, model(input_ids=ids, labels=ids).loss, clip))
    return losses


AUTOTP_SHAPES = {"q_proj": [16, 32], "o_proj": [32, 16], "down_proj": [32, 32]}
"""Layer 0's projections on rank 0 at autotp_size 2: q_proj column-split (32 -> 16 rows), o_proj and down_proj
row-split (their inputs halved)."""


def test_autotp_llama_trains_like_the_oracle_under_the_deepspeed_command():
    """DeepSpeed's AutoTP training pattern (a whole LlamaForCausalLM, "tensor_parallel": {"autotp_size": 2}) at
    world 2: split as DeepSpeed splits it, on the single-process losses."""
    ours = run_script("autotp_llama.py", "--zero_stage", "1", world=2, launcher="deepspeed")
    assert ours["shapes"] == AUTOTP_SHAPES and ours["steps"] == 3
    assert ours["losses"] == pytest.approx(_autotp_oracle(), rel=RTOL)


@pytest.mark.deepspeed_parity
@needs_deepspeed
@pytest.mark.parametrize("zero", ["0", "1"])
def test_autotp_llama_matches_deepspeed(zero):
    """The real DeepSpeed 0.19.8 runs AutoTP training on CPU (gloo): the same split and the same losses."""
    theirs = run_script("autotp_llama.py", "--zero_stage", zero, world=2, python=deepspeed_python(), timeout=600)
    ours = run_script("autotp_llama.py", "--zero_stage", zero, world=2)
    assert ours["shapes"] == theirs["shapes"] == AUTOTP_SHAPES
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=RTOL)
