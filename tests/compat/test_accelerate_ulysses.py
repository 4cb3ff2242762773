"""Ulysses sequence parallelism in a plain accelerate loop (scripts/accelerate_ulysses.py), switched on by
accelerate's config file alone: `accelerate launch --config_file cfg.yaml script.py` with distributed_type
DEEPSPEED, its deepspeed_config (accelerate's own keys, or a deepspeed_config_file) and a parallelism_config whose
keys accelerate turns into the PARALLELISM_CONFIG_* variables `Accelerator()` reads. World 2, sp 2, on
shardwise's compatibility package against the full-sequence oracle of hf_trainer_ulysses.py (fp32, SGD at a fixed
rate, per-step losses within 1e-5, every rank's forwards on the oracle's samples); with the real DeepSpeed 0.19.8
its runs are held to the oracle at DeepSpeed's own gradient scale (test_trainer_ulysses.py says why it is sp at
ZeRO 0-2: the loss combined over the sequence group is the same on every rank, and its all_gather's backward sums
the ranks' gradients)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compat.run import deepspeed_python, run_script

RTOL = 1e-5
WORLD, SP, SEQ = 2, 2, 32
PARALLELISM = f"""parallelism_config:
  parallelism_config_sp_size: {SP}
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_attn_implementation: sdpa
"""
# accelerate writes a YAML gradient_clipping of 0 as no key at all, and DeepSpeed's default (shardwise's too) is
# 1.0, which would clip this model's gradient norms (~3-6) and hide the scale under test: 100 never clips here.
ACCELERATE_KEYS = f"""compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
num_machines: 1
num_processes: {WORLD}
mixed_precision: 'no'
deepspeed_config:
  zero_stage: 2
  gradient_accumulation_steps: 1
  gradient_clipping: 100.0
  offload_optimizer_device: none
  offload_param_device: none
{PARALLELISM}  parallelism_config_sp_seq_length_is_variable: true
"""
# with a deepspeed_config_file accelerate refuses its own ZeRO/precision keys beside it
CONFIG_FILE = f"""compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
num_machines: 1
num_processes: {WORLD}
deepspeed_config:
  deepspeed_config_file: {{ds_json}}
{PARALLELISM}  parallelism_config_sp_seq_length: {SEQ}
  parallelism_config_sp_seq_length_is_variable: false
"""
DS_JSON = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.0, "train_batch_size": "auto",
           "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
CASES = {  # name: (YAML, ZeRO stage, the loader's batch size)
    "zero2-accelerate-keys-batch1": (ACCELERATE_KEYS, 2, 1),
    # each rank's shard a slice of two rows; ZeRO-3 partitions the parameters over the sequence group
    "zero3-deepspeed-config-file-batch2": (CONFIG_FILE, 3, 2),
}
needs_deepspeed = pytest.mark.skipif(deepspeed_python() is None, reason="needs the real DeepSpeed: "
                                     "SHARDWISE_DEEPSPEED_PYTHON (set by `make test-deepspeed`, which .ci/run runs)")


def deepspeed_gradient_scale(stage: int) -> int:
    """What the real DeepSpeed 0.19.8 multiplies the loss's gradient by here (shardwise: 1)."""
    return 1 if stage == 3 else SP


def _write_config(case: str, where: Path) -> Path:
    text, _, _ = CASES[case]
    where.mkdir(parents=True, exist_ok=True)
    ds_json = where / "ds_config.json"
    ds_json.write_text(json.dumps(DS_JSON))
    config = where / "accelerate_config.yaml"
    config.write_text(text.replace("{ds_json}", str(ds_json)))
    return config


def _launch(case: str, where: Path, python: str | None = None) -> dict:
    _, _, batch = CASES[case]
    kwargs = {"python": python} if python else {}
    return run_script("accelerate_ulysses.py", "--batch", str(batch), world=WORLD, launcher="accelerate",
                      accelerate_args=["--config_file", str(_write_config(case, where))], **kwargs)


@pytest.fixture(scope="module")
def oracles() -> dict:
    cache = {}

    def get(case: str, grad_scale: int = 1) -> dict:
        if (case, grad_scale) not in cache:
            cache[case, grad_scale] = run_script(
                "hf_trainer_ulysses.py", "--oracle", "--world", str(WORLD), "--sp", str(SP), "--ga", "1",
                "--per_device_train_batch_size", str(CASES[case][2]), "--grad_scale", str(grad_scale))
        return cache[case, grad_scale]
    return get


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict:
    cache = {}

    def get(case: str) -> dict:
        if case not in cache:
            cache[case] = _launch(case, tmp_path_factory.mktemp(case))
        return cache[case]
    return get


def _assert_matches_oracle(result: dict, oracle: dict, case: str, who: str) -> None:
    # the config file, not the script, must have turned it all on
    assert (result["distributed_type"], result["processes"], result["sp_size"]) == ("DistributedType.DEEPSPEED",
                                                                                   WORLD, SP), result
    assert result["loader"] == "UlyssesSPDataLoaderAdapter" and result["sp_attn_implementation"] == "sdpa", result
    assert result["zero_stage"] == CASES[case][1], result
    micro_batches = [batch for step in oracle["samples"] for batch in step]
    for rank, seen in enumerate(result["seen"]):
        assert seen == micro_batches, f"{who} rank {rank}: its forwards computed samples {seen}, the steps' " \
                                      f"micro-batches are {micro_batches}"
    assert all(losses == result["losses"] for losses in result["rank_losses"]), result["rank_losses"]
    for i, (a, b) in enumerate(zip(result["losses"], oracle["losses"], strict=True)):
        assert a == pytest.approx(b, rel=RTOL), f"{who} step {i + 1}: loss {a} vs oracle {b}"


@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_config_file_sequence_parallel_matches_the_oracle(oracles, ours, case):
    result = ours(case)
    assert result["engine"] == "Engine"
    _assert_matches_oracle(result, oracles(case), case, "shardwise")


@pytest.mark.deepspeed_parity
@needs_deepspeed
@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_config_file_sequence_parallel_matches_deepspeed(oracles, tmp_path, case):
    """DeepSpeed against the oracle at its own gradient scale; shardwise is held to the full-sequence oracle by the
    test above in the same CI run, and at scale 2 the two oracles part after the first step."""
    theirs = _launch(case, tmp_path, python=deepspeed_python())
    assert theirs["engine"] == "DeepSpeedEngine"
    scale = deepspeed_gradient_scale(CASES[case][1])
    _assert_matches_oracle(theirs, oracles(case, scale), case, "DeepSpeed")
    if scale != 1:
        assert oracles(case)["losses"][1:] != pytest.approx(theirs["losses"][1:], rel=RTOL)
