"""The way back: shardwise saves at step 3 (world size 2), `shardwise checkpoint export --to deepspeed` writes
DeepSpeed's layout at a world size and ZeRO stage, and DeepSpeed 0.19.8 resumes it with `load_checkpoint`: its
next 3 losses are those of shardwise's uninterrupted run (fp32 within 1e-5 relative, as the Adam kernels differ
by a few ulps a step; bf16 and fp16 within two and one ulps, fp16's loss scale taken over), and DeepSpeed's own zero_to_fp32 consolidation of the export equals shardwise's
consolidation of the source exactly. The same for a run saving in DeepSpeed's layout directly
(`"checkpoint": {"format": "deepspeed"}`).

DeepSpeed is a reference here, never a dependency: `make test-deepspeed` runs this module in .dsvenv, or by hand:

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python -m pytest tests/distributed/test_deepspeed_checkpoint_export.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reference import real_deepspeed

real_deepspeed()  # imported once here so the forked ranks inherit it; skips in shardwise's own venv

from shardwise.checkpoint.cli import main as checkpoint_cli  # noqa: E402
from shardwise.checkpoint.reader import open_checkpoint  # noqa: E402
from tests.deepspeed_checkpoints import MORE, SAVED_AT, resume, resumed_precision, save_and_continue  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

SAVED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "zero1": ({"stage": 1}, {}),
    "zero2": ({"stage": 2}, {}),
    "zero3": ({"stage": 3}, {}),
    "zero2-bf16": ({"stage": 2}, {"bf16": {"enabled": True}}),
    "zero3-fp16": ({"stage": 3}, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
}
# Saved by shardwise in DeepSpeed's layout directly (checkpoint.format), resumed by DeepSpeed as saved.
DIRECT: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "zero2-direct": ({"stage": 2}, {"checkpoint": {"format": "deepspeed"}}),
    "zero3-direct": ({"stage": 3}, {"checkpoint": {"format": "deepspeed"}}),
}
# (saved case, DeepSpeed's world size, DeepSpeed's stage)
EXPORTS = [("zero1", 2, 1), ("zero2", 2, 2), ("zero3", 2, 3), ("zero2", 2, 3), ("zero3", 2, 1), ("zero3", 1, 2),
           ("zero1", 4, 3), ("zero2-bf16", 2, 2), ("zero3-fp16", 2, 3)]
RTOL = {"bf16": 2**-7, "fp16": 2**-10}  # two bf16 ulps, one fp16 ulp (test_deepspeed_checkpoint_migration.py)


def _name(case: str, world: int, stage: int) -> str:
    return f"{case}-as-world{world}-stage{stage}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[float]], dict[tuple[str, int, int], dict[str, Any]]]:
    root = tmp_path_factory.mktemp("exports")
    ours = run_distributed(save_and_continue, 2, "shardwise", str(root / "shardwise"), {**SAVED, **DIRECT},
                           timeout=600)[0]
    for case, world, stage in EXPORTS:
        assert checkpoint_cli(["export", "--to", "deepspeed", "--world", str(world), "--stage", str(stage),
                               str(root / "shardwise" / case), str(root / _name(case, world, stage))]) == 0
    theirs = {}
    for world in sorted({w for _, w, _ in EXPORTS}):
        loads = [(str(root / _name(c, w, s)), s, resumed_precision(SAVED[c][1])) for c, w, s in EXPORTS if w == world]
        if world == 2:
            loads += [(str(root / "shardwise" / case), zero["stage"], {}) for case, (zero, _) in DIRECT.items()]
        for (path, _), result in run_distributed(resume, world, "deepspeed", loads, timeout=600)[0].items():
            theirs[Path(path).name] = result
    return root, ours, theirs


@pytest.mark.parametrize("case,world,stage", EXPORTS, ids=[_name(*e) for e in EXPORTS])
def test_deepspeed_resumes_an_export_with_shardwises_losses(runs, case, world, stage):
    _, ours, theirs = runs
    result = theirs[_name(case, world, stage)]
    assert result["case"] == case and result["global_steps"] == SAVED_AT + MORE
    precision = next(iter(SAVED[case][1]), "fp32")
    if precision == "fp16":
        assert result["loss_scale"] == 2.0**8, "shardwise's loss scale (2**8, no overflow) was not taken over"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ours[case]), rtol=RTOL.get(precision, 1e-5), atol=0,
                               msg=lambda m: f"DeepSpeed {result['losses']} vs shardwise {ours[case]}: {m}")


@pytest.mark.parametrize("case,world,stage", EXPORTS, ids=[_name(*e) for e in EXPORTS])
def test_deepspeeds_zero_to_fp32_equals_shardwises_consolidation(runs, case, world, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, _, _ = runs
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(root / _name(case, world, stage)))
    reader = open_checkpoint(root / "shardwise" / case)
    assert set(theirs) == set(reader.meta["params"])
    for name, value in theirs.items():
        kind = "master" if reader.meta["params"][name]["trainable"] else "value"
        assert torch.equal(value, reader.read_full(name, kind)), name


@pytest.mark.parametrize("case", DIRECT)
def test_deepspeed_resumes_a_save_in_its_layout(runs, case):
    root, ours, theirs = runs
    folder = root / "shardwise" / case
    assert (folder / "latest").read_text() == f"global_step{SAVED_AT}" and not (folder / ".shardwise-staging").exists()
    result = theirs[case]
    assert result["case"] == case and result["global_steps"] == SAVED_AT + MORE
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ours[case]), rtol=1e-5, atol=0,
                               msg=lambda m: f"DeepSpeed {result['losses']} vs shardwise {ours[case]}: {m}")
