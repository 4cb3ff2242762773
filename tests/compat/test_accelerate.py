"""accelerate's DeepSpeed integration on shardwise's compatibility package: a `DeepSpeedPlugin(hf_ds_config=...)`
built in the script, and `accelerate launch --use_deepspeed`, against the same loop on plain accelerate.

On CPU, accelerate hands DeepSpeed one process (it counts num_processes as 1 there, so a two-process run
fails DeepSpeed's batch check, real DeepSpeed's as well as shardwise's); these runs are world size 1."""

from __future__ import annotations

import pytest

from tests.compat.run import deepspeed_python, run_script


@pytest.fixture(scope="module")
def plain() -> dict:
    return run_script("accelerate_loop.py")


def test_plugin_in_the_script(plain):
    result = run_script("accelerate_loop.py", "--plugin", "--stage", "2")
    assert result["engine"] == "Engine" and plain["engine"] == "LlamaForCausalLM"
    assert result["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_accelerate_launch_use_deepspeed(plain):
    result = run_script("accelerate_loop.py", launcher="accelerate",
                        accelerate_args=["--zero_stage", "3", "--gradient_accumulation_steps", "2"])
    assert result["engine"] == "Engine"
    assert result["losses"] == pytest.approx(plain["losses"], rel=1e-5)


@pytest.mark.deepspeed_parity
@pytest.mark.skipif(deepspeed_python() is None, reason="needs the real DeepSpeed: SHARDWISE_DEEPSPEED_PYTHON "
                    "(set by `make test-deepspeed`, which .ci/run runs)")
def test_accelerate_launch_matches_deepspeed(plain):
    """DeepSpeed's run against the plain loop, which shardwise's same launch matches in the test above (same CI run):
    launching shardwise's again here would prove nothing more."""
    flags = ["--zero_stage", "3", "--gradient_accumulation_steps", "2"]
    theirs = run_script("accelerate_loop.py", launcher="accelerate", accelerate_args=flags, python=deepspeed_python())
    assert theirs["engine"] == "DeepSpeedEngine"
    assert theirs["losses"] == pytest.approx(plain["losses"], rel=1e-5)
