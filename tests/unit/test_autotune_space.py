"""The autotuner's search space (autotune/space.py) read from configs, and the pieces of an experiment that
need no process: the script's config flag, arg_mappings, the launcher options without --autotuning."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.autotune.cli import _without_autotuning
from shardwise.autotune.experiment import ExperimentError, Launch
from shardwise.autotune.space import Candidate, SpaceError, read_space
from shardwise.config import parse_config
from shardwise.config.autotuning import AutotuningConfig

FAST, SLOW = AutotuningConfig(), AutotuningConfig(fast=False)
BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_a_fixed_train_batch_is_held_by_every_candidate() -> None:
    space = read_space({**BASE, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 2, FAST)
    assert space.micro_batches == ((2, 8), (4, 4), (8, 2), (16, 1))
    assert space.stages == (0, 1, 2, 3)
    for candidate in space.candidates():
        cfg = parse_config(space.config(candidate, 2), dp_size=2)
        assert cfg.train_batch_size == 32 and cfg.zero_optimization.stage == candidate.stage


def test_lists_are_the_space_and_single_values_fix_it() -> None:
    raw = {**BASE, "train_batch_size": 16, "train_micro_batch_size_per_gpu": [2, 8, 3],
           "zero_optimization": {"stage": [1, 3], "offload_optimizer": {"device": "none"}}}
    space = read_space(raw, 2, FAST)
    assert space.stages == (1, 3) and space.micro_batches == ((2, 4), (8, 1))  # 3 does not divide 8 per rank
    assert space.offload_optimizer == ("none",) and space.offload_param == ("none", "cpu")
    assert [c.name for c in space.candidates()][:3] == ["z1_tmbspg2_gas4", "z1_tmbspg8_gas1", "z3_tmbspg2_gas4"]


def test_without_a_fixed_batch_the_micro_batch_doubles_up_to_the_limits() -> None:
    section = AutotuningConfig(max_train_micro_batch_size_per_gpu=16, max_train_batch_size=48)
    space = read_space({**BASE, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": [1, 2]}, 2, section)
    assert space.micro_batches == ((2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2), (16, 1))  # 16x2x2 ranks > 48


def test_offload_modes_follow_the_stage_and_move_the_least_first() -> None:
    space = read_space({**BASE, "train_batch_size": 8, "zero_optimization": {
        "offload_optimizer": {"nvme_path": "/nvme"}}}, 1, FAST)
    assert space.offload_modes(0) == [("none", "none")]
    assert space.offload_modes(1) == [("none", "none"), ("cpu", "none"), ("nvme", "none")]
    assert space.offload_modes(3)[:4] == [("none", "none"), ("cpu", "none"), ("nvme", "none"), ("none", "cpu")]
    candidate = Candidate(3, 8, 1, "nvme", "nvme")
    overrides = candidate.overrides(1, space.nvme_path)
    assert overrides["zero_optimization.offload_param.nvme_path"] == "/nvme"
    assert parse_config(space.config(candidate, 1)).zero_optimization.offload_param.device == "nvme"
    assert candidate.name == "z3_tmbspg8_gas1_oonvme_opnvme"
    assert space.tightest() == Candidate(3, 1, 8, "cpu", "cpu")  # the profiling run: least on the device, no disk


def test_knobs_are_tuned_when_not_fast_or_when_listed() -> None:
    raw = {**BASE, "train_batch_size": 8, "zero_optimization": {"stage3_max_reuse_distance": [0, 1e9],
                                                                "reduce_bucket_size": 1000}}
    fast = read_space(raw, 1, FAST)
    assert fast.knobs == {"zero_optimization.stage3_max_reuse_distance": (0, 1_000_000_000)}
    assert fast.base["zero_optimization"]["reduce_bucket_size"] == 1000  # a single value stays as given
    slow = read_space({**BASE, "train_batch_size": 8}, 1, SLOW)
    assert set(slow.knob_values(3)) == {k for k in slow.knobs if "stage3" in k}
    assert list(slow.knob_values(1)) == ["zero_optimization.reduce_bucket_size"]


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"stage": [1, 5]}, "train_batch_size": 8}, "zero_optimization.stage: 5 is not one of [0, 1, 2, 3]"),
    ({"zero_optimization": {"stage": []}, "train_batch_size": 8}, "zero_optimization.stage: an empty list tunes nothing"),
    ({"zero_optimization": {"offload_optimizer": {"device": ["none", "nvme"]}}, "train_batch_size": 8},
     "is not one of ['none', 'cpu']"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": [1, 2]}, "gradient_accumulation_steps: a list cannot be tuned"),
    ({"train_batch_size": 9}, "train_batch_size (9): not divisible by the 2 data-parallel ranks"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": [3]}, "none of [3] divides train_batch_size / ranks = 4"),
    ({"train_batch_size": 8, "zero_optimization": {"stage3_prefetch_bucket_size": [-1]}}, "is not whole numbers"),
])
def test_a_bad_space_names_the_key(raw: dict, message: str) -> None:
    with pytest.raises(SpaceError, match=None) as error:
        read_space({**BASE, **raw}, 2, FAST)
    assert message in str(error.value)


def test_the_config_flag_and_mapped_flags_are_rewritten(tmp_path: Path) -> None:
    launch = Launch(("--num_gpus", "2"), ("train.py", "--deepspeed", "ds.json", "--per_device_train_batch_size=1",
                                           "--lr", "1e-3"))
    assert launch.config_path() == "ds.json"
    argv = launch.argv(tmp_path / "c.json", {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                                             "gradient_accumulation_steps ": "--gradient_accumulation_steps"},
                       {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2})
    assert argv == ["--num_gpus", "2", "train.py", "--deepspeed", str(tmp_path / "c.json"),
                    "--per_device_train_batch_size=8", "--lr", "1e-3", "--gradient_accumulation_steps", "2"]
    with pytest.raises(ExperimentError, match="name no DeepSpeed config"):
        Launch((), ("train.py", "--lr", "1")).config_path()


def test_the_autotuning_flag_is_taken_out_of_the_launcher_options() -> None:
    assert _without_autotuning(["--autotuning", "run", "--num_gpus", "2"]) == ["--num_gpus", "2"]
    assert _without_autotuning(["--num_gpus=2", "--autotuning=tune"]) == ["--num_gpus=2"]
    assert _without_autotuning(["--autotun", "tune", "--master_port", "1"]) == ["--master_port", "1"]
