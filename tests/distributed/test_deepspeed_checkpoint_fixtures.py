"""shardwise resumes the DeepSpeed 0.19.8 checkpoints in tests/data (ZeRO 2 and 3, saved at world size 2 after 3
steps) at world size 1 and 2 and at other stages, and its next 3 losses are those DeepSpeed's uninterrupted run
recorded there (reference.json), within 1e-5 relative (fp32; the Adam kernels differ by a few ulps a step); also
the universal checkpoint DeepSpeed's ds_to_universal.py made of the ZeRO-2 one.

The same comparison against a live DeepSpeed, over more layouts, precisions and offload, is
test_deepspeed_checkpoint_migration.py (`make test-deepspeed`); this one runs everywhere, without DeepSpeed.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.checkpoint.deepspeed_import import import_deepspeed
from tests.deepspeed_checkpoints import FIXTURES, MORE, SAVED_AT, resume, save_and_continue
from tests.harness import run_distributed

REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
# world size -> (saved case, shardwise's stage)
LOADS = {1: [("zero2", 2), ("zero3", 3), ("zero3", 0), ("zero2_universal", 3)],
         2: [("zero2", 3), ("zero3", 1), ("zero3", 3), ("zero2_universal", 1)]}


@pytest.mark.parametrize("world", LOADS)
def test_resumes_deepspeeds_checkpoints_with_its_losses(world):
    loads = [(str(FIXTURES / case), stage, {}) for case, stage in LOADS[world]]
    results = run_distributed(resume, world, "shardwise", loads, timeout=300)[0]
    for (path, stage), result in results.items():
        case = path.rsplit("/", 1)[-1]
        assert result["case"] == case.removesuffix("_universal") and result["global_steps"] == SAVED_AT + MORE
        reference = REFERENCE["losses_after"][case.removesuffix("_universal")]  # ds_to_universal of zero2
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference),
                                   rtol=1e-5, atol=0, msg=lambda m: f"{case} at world {world}, stage {stage}: {m}")


def test_a_save_in_deepspeeds_layout_resumes_in_shardwise(tmp_path):
    """`"checkpoint": {"format": "deepspeed"}` at world size 2, ZeRO 3: DeepSpeed's files only, and shardwise
    resumes them at world size 1, ZeRO 2, with the uninterrupted run's losses."""
    direct = {"direct": ({"stage": 3}, {"checkpoint": {"format": "deepspeed"}})}
    ours = run_distributed(save_and_continue, 2, "shardwise", str(tmp_path), direct, timeout=300)[0]
    assert sorted(p.name for p in (tmp_path / "direct").iterdir()) == [f"global_step{SAVED_AT}", "latest"]
    assert sorted(p.name for p in (tmp_path / "direct" / f"global_step{SAVED_AT}").iterdir()) == [
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
    result = run_distributed(resume, 1, "shardwise", [(str(tmp_path / "direct"), 2, {})], timeout=300)[0]
    (losses,) = [r["losses"] for r in result.values()]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ours["direct"]), rtol=1e-5, atol=0)


def test_an_imported_copy_resumes_with_deepspeeds_losses(tmp_path):
    import_deepspeed(FIXTURES / "zero2", tmp_path / "copy")
    result = run_distributed(resume, 2, "shardwise", [(str(tmp_path / "copy"), 3, {})], timeout=300)[0]
    ((_, outcome),) = result.items()
    assert outcome["case"] == "zero2" and outcome["global_steps"] == SAVED_AT + MORE
    torch.testing.assert_close(torch.tensor(outcome["losses"]), torch.tensor(REFERENCE["losses_after"]["zero2"]),
                               rtol=1e-5, atol=0)
