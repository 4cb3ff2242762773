"""Hugging Face's Trainer with `TrainingArguments(deepspeed=...)` on shardwise's compatibility package, against
the oracle: the same script as a plain Trainer run (no DeepSpeed; DDP at world size 2). Hugging Face builds
the optimizer and scheduler in both (the config has no optimizer section), so fp32 losses, gradient norms
and saved weights must agree to 1e-5. Real DeepSpeed's numbers for the same script are compared in
test_trainer_parity.py (`make test-deepspeed`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.compat.run import run_script

RTOL = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("base") / "llama")


def _run(base: str, out: Path, *flags: str, world: int = 1, launcher: str = "torchrun") -> dict:
    result = run_script("hf_trainer.py", "--out", str(out), "--base", base, *flags, world=world, launcher=launcher)
    result["dir"] = out / "final"
    return result


@pytest.fixture(scope="module")
def oracle(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    return {
        "full": _run(base, root / "full", "--no-deepspeed"),
        "lora": _run(base, root / "lora", "--no-deepspeed", "--lora"),
        "full2": _run(base, root / "full2", "--no-deepspeed", world=2),
    }


def _assert_same(result: dict, reference: dict, weights: str = "model.safetensors") -> None:
    assert result["steps"] == reference["steps"] == [1, 2, 3, 4]
    for name in ("losses", "grad_norms"):
        for i, (a, b) in enumerate(zip(result[name], reference[name])):
            assert a == pytest.approx(b, rel=RTOL), f"step {i + 1}: {name} {a} vs oracle {b}"
    ours, theirs = load_file(result["dir"] / weights), load_file(reference["dir"] / weights)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=RTOL, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_zero0_full_finetune(base, oracle, tmp_path):
    _assert_same(_run(base, tmp_path, "--stage", "0"), oracle["full"])


def test_zero3_gradient_checkpointing_saves_full_weights(base, oracle, tmp_path):
    # stage3_gather_16bit_weights_on_model_save: save_model writes the whole model, which from_pretrained loads
    result = _run(base, tmp_path, "--stage", "3", "--gc")
    _assert_same(result, oracle["full"])
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(result["dir"])
    assert all(p.numel() > 0 for p in model.parameters())


def test_zero3_cpu_offload_lora(base, oracle, tmp_path):
    result = _run(base, tmp_path, "--stage", "3", "--offload", "--lora", "--gc")
    assert "adapter_model.safetensors" in result["saved"]
    _assert_same(result, oracle["lora"], weights="adapter_model.safetensors")


# One run under the `deepspeed` command, as Trainer users launch; the other with torchrun's environment in a fork of
# a pre-imported interpreter (run.py), which spares it ~10 s of imports per rank.
@pytest.mark.parametrize("stage,offload,launcher", [(2, True, "deepspeed"), (3, False, "torchrun")])
def test_two_processes(base, oracle, tmp_path, stage, offload, launcher):
    flags = ["--stage", str(stage), *(["--offload"] if offload else [])]
    _assert_same(_run(base, tmp_path, *flags, world=2, launcher=launcher), oracle["full2"])


def test_resume_from_checkpoint_continues_the_run(base, tmp_path):
    whole = _run(base, tmp_path / "whole", "--stage", "3", "--save_steps", "2")
    assert (tmp_path / "whole" / "checkpoint-2" / "global_step2").is_dir()
    resumed = _run(base, tmp_path / "resumed", "--stage", "3", "--resume", str(tmp_path / "whole" / "checkpoint-2"))
    # The log of steps 1-2 comes back with the checkpoint's trainer state; steps 3-4 are trained again
    assert resumed["steps"] == whole["steps"] == [1, 2, 3, 4]
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=RTOL)
    assert resumed["grad_norms"][2:] == pytest.approx(whole["grad_norms"][2:], rel=RTOL)
