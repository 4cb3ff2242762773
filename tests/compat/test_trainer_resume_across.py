"""A Hugging Face Trainer run moved between DeepSpeed 0.19.8 and shardwise mid-way, both ways:
`Trainer.train(resume_from_checkpoint=".../checkpoint-2")` on a `checkpoint-N` folder the other library wrote
(shardwise saving in DeepSpeed's layout with `"checkpoint": {"format": "deepspeed"}`), and the resumed steps'
losses equal the uninterrupted run's within 1e-5 (fp32). ZeRO-2 full fine-tuning at two processes, ZeRO-3 LoRA
at one (two-process ZeRO-3 fails in the real DeepSpeed on CPU; see test_trainer_parity.py).

Needs an interpreter with the real DeepSpeed: `make test-deepspeed` (as .ci/run does) sets
SHARDWISE_DEEPSPEED_PYTHON to .dsvenv's."""

from __future__ import annotations

import pytest

from tests.compat.run import deepspeed_python, run_script

pytestmark = [
    pytest.mark.deepspeed_parity,
    pytest.mark.skipif(deepspeed_python() is None, reason="needs the real DeepSpeed: SHARDWISE_DEEPSPEED_PYTHON "
                       "(set by `make test-deepspeed`, which .ci/run runs)"),
]
RTOL = 1e-5
CASES = {"zero2-full": (["--stage", "2", "--ds_optimizer"], 2), "zero3-lora": (["--stage", "3", "--lora"], 1)}
STEPS, SAVED_AT = ["--steps", "4"], ["--save_steps", "2"]


def _run(tmp_path, library: str, out: str, *args: str, world: int) -> dict:
    if library == "deepspeed":
        return run_script("hf_trainer.py", "--out", str(tmp_path / out), "--base", str(tmp_path / "base"), *args,
                          world=world, python=deepspeed_python())
    return run_script("hf_trainer.py", "--out", str(tmp_path / out), "--base", str(tmp_path / "base"), *args,
                      world=world)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("saver,resumer", [("deepspeed", "shardwise"), ("shardwise", "deepspeed")])
def test_trainer_resumes_the_other_librarys_checkpoint(case, saver, resumer, tmp_path):
    flags, world = CASES[case]
    layout = ["--save_format", "deepspeed"] if saver == "shardwise" else []
    whole = _run(tmp_path, saver, "saved", *flags, *STEPS, *SAVED_AT, *layout, world=world)
    checkpoint = tmp_path / "saved" / "checkpoint-2"
    assert (checkpoint / "latest").read_text().strip() == "global_step2"
    resumed = _run(tmp_path, resumer, "resumed", *flags, *STEPS, "--resume", str(checkpoint), world=world)
    # The resumed log starts with the saved run's first two entries (trainer_state.json); steps 3-4 trained anew.
    assert resumed["steps"] == whole["steps"] == [1, 2, 3, 4] and resumed["losses"][:2] == whole["losses"][:2]
    assert resumed["losses"][2:] == pytest.approx(whole["losses"][2:], rel=RTOL), (resumed["losses"], whole["losses"])
