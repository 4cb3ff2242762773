"""DeepSpeed's checkpoint files, read without DeepSpeed and without running anything they hold.

The folders in tests/data/deepspeed_0_19_8_checkpoints/ are what DeepSpeed 0.19.8 wrote for TinyNet at world
size 2 (ZeRO 2 and 3), with DeepSpeed's own consolidation of each (`fp32.safetensors`, from its
zero_to_fp32); make.py there rewrites them. Every parameter read by name must equal DeepSpeed's consolidation
exactly, and a file that names any global beyond the few DeepSpeed objects a checkpoint holds is refused with
its name, in whichever slot of the folder it sits, before anything in it runs.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint.deepspeed_export import export_deepspeed
from shardwise.checkpoint.deepspeed_pickle import load_deepspeed_object
from shardwise.checkpoint.deepspeed_reader import DeepSpeedReader
from shardwise.checkpoint.deepspeed_universal import UniversalReader
from shardwise.checkpoint.cli import main as checkpoint_cli
from shardwise.checkpoint.reader import CheckpointReader, open_checkpoint

FIXTURES = Path(__file__).parents[1] / "data" / "deepspeed_0_19_8_checkpoints"
STAGES = {"zero2": 2, "zero3": 3}


def _copy(tmp_path: Path, case: str) -> Path:
    return Path(shutil.copytree(FIXTURES / case, tmp_path / case))


@pytest.mark.parametrize("case", STAGES)
def test_every_parameter_equals_deepspeeds_own_consolidation(case):
    reader = open_checkpoint(FIXTURES / case)  # the save directory: `latest` names global_step3
    assert isinstance(reader, DeepSpeedReader) and reader.path == FIXTURES / case / "global_step3"
    expected = load_file(str(FIXTURES / case / "fp32.safetensors"))
    assert set(reader.meta["params"]) == set(expected)
    for name, value in expected.items():
        kind = "master" if reader.trainable[name] else "value"
        assert torch.equal(reader.read_full(name, kind), value), name
    meta = reader.meta
    assert (meta["stage"], meta["world_size"], meta["client_state"]) == (STAGES[case], 2, {"case": case})
    assert meta["counters"]["global_steps"] == 3 and meta["lr_scheduler"] == {"last_batch_iteration": 2}
    assert meta["optimizer"]["scalars"] == {"step": 3.0} and len(meta["optimizer"]["param_groups"]) == 2
    assert reader.kinds("hidden.weight") == {"master", "state.exp_avg", "state.exp_avg_sq"}
    assert reader.kinds("frozen.weight") == {"value"}


@pytest.mark.parametrize("case", STAGES)
def test_ranges_across_deepspeeds_partitions(case):
    """Any element range, wherever DeepSpeed's partition boundaries fall, reads what the whole tensor holds."""
    reader = DeepSpeedReader(FIXTURES / case / "global_step3")
    for name in ("hidden.weight", "out.bias", "norm.bias"):
        for kind in ("master", "state.exp_avg_sq"):
            whole = reader.read_full(name, kind).reshape(-1)
            for start, end in ((0, 1), (5, whole.numel() - 3), (whole.numel() // 2, whole.numel())):
                out = torch.full((end - start,), float("nan"))
                reader.read_into(name, kind, start, end, out)
                assert torch.equal(out, whole[start:end]), (name, kind, start, end)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("case", [*STAGES, "zero2_universal"])
def test_a_file_that_would_run_code_is_refused_in_every_slot(tmp_path, case):
    slots = sorted(p.relative_to(FIXTURES / case) for p in (FIXTURES / case).rglob("*.pt"))
    assert len(slots) >= 3
    for i, slot in enumerate(slots):
        root = _copy(tmp_path / str(i), case)
        marker = tmp_path / f"ran-{i}"
        original = load_deepspeed_object(root / slot)  # memory-mapped: replaced, not rewritten
        entries = original if isinstance(original, dict) else {"step": original}  # a universal step.pt is an int
        torch.save({"payload": _RunsCode(marker), **entries}, tmp_path / "crafted.pt")  # the payload is met first
        os.replace(tmp_path / "crafted.pt", root / slot)
        with pytest.raises(CheckpointError) as info:
            reader = open_checkpoint(root)
            for name in reader.meta["params"]:  # a universal folder opens a parameter's files when it is read
                for kind in reader.kinds(name):
                    reader.read_full(name, kind)
        message = str(info.value)
        assert message.startswith(f"{root / slot}: refused: the file names "), message
        assert "system'" in message and "nothing in it was run" in message
        assert not marker.exists()


def test_truncated_missing_and_foreign_files(tmp_path):
    root = _copy(tmp_path, "zero2")
    optim = root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(optim))}: not a readable torch.save file"):
        open_checkpoint(root)
    optim.unlink()
    with pytest.raises(CheckpointError, match=r"holds 2 zero_pp_rank_\*_optim_states.pt files \(ranks 0-1\); found "
                                              r"ranks \[0\]"):
        open_checkpoint(root)
    model = root / "global_step3" / "mp_rank_00_model_states.pt"
    torch.save([1, 2, 3], model)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(model))}: holds a list, not the dict DeepSpeed saves"):
        open_checkpoint(root)


def test_tensor_parallel_checkpoints_are_refused_by_name(tmp_path):
    root = _copy(tmp_path, "zero2")
    (root / "global_step3" / "mp_rank_01_model_states.pt").write_bytes(b"never opened")
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(root / 'global_step3'))}: a DeepSpeed checkpoint "
                                              r"with model \(tensor\) parallelism \(2 mp_rank files\)"):
        open_checkpoint(root)


def test_a_save_directory_without_latest_names_its_newest_tag(tmp_path):
    root = _copy(tmp_path, "zero2")
    (root / "global_step3").rename(root / "global_step10")
    shutil.copytree(root / "global_step10", root / "global_step9")
    (root / "latest").unlink()
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(root)
    assert str(info.value).startswith(f"{root}: holds DeepSpeed checkpoints (global_step10/ holds mp_rank_00_model_"
                                      "states.pt, ") and "pass tag='global_step10'" in str(info.value)
    assert open_checkpoint(root, "global_step9").path == root / "global_step9"


def test_other_folders_keep_their_messages(tmp_path):
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "model_states.pt").write_bytes(b"")  # not a name DeepSpeed writes
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match="manifest.json: missing; .* is not a complete shardwise checkpoint."):
        open_checkpoint(tmp_path)
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("case,world,stage", [("zero3", 1, 2), ("zero2", 4, 3), ("zero2", 3, 1), ("zero3", 2, 3)])
def test_export_writes_deepspeeds_layout_that_reads_back_equal(tmp_path, case, world, stage):
    """DeepSpeed's checkpoint exported at another layout (DeepSpeed->DeepSpeed resharding): every element of every
    parameter and optimizer state, and the counters, read back as the source holds them."""
    written = export_deepspeed(FIXTURES / case, tmp_path, world, stage, tag="moved")
    assert written == tmp_path / "moved" and (tmp_path / "latest").read_text() == "moved"
    source, moved = open_checkpoint(FIXTURES / case), open_checkpoint(tmp_path)
    assert isinstance(moved, DeepSpeedReader) and (moved.stage, moved.world) == (stage, world)
    for name in source.meta["params"]:
        assert moved.kinds(name) == source.kinds(name)
        for kind in source.kinds(name):
            assert torch.equal(moved.read_full(name, kind), source.read_full(name, kind)), (name, kind)
    for key in ("counters", "lr_scheduler", "client_state"):
        assert moved.meta[key] == source.meta[key], key
    assert moved.meta["optimizer"]["scalars"] == source.meta["optimizer"]["scalars"]
    assert moved.meta["optimizer"]["groups"] == source.meta["optimizer"]["groups"]


def test_export_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(CheckpointError, match="ZeRO stage 0 is not written"):
        export_deepspeed(FIXTURES / "zero2", tmp_path, 2, 0)
    export_deepspeed(FIXTURES / "zero2", tmp_path, 2, 2)
    with pytest.raises(CheckpointError, match=f"^export: {re.escape(str(tmp_path / 'global_step3'))} exists"):
        export_deepspeed(FIXTURES / "zero2", tmp_path, 2, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "latest"]  # no partial folder left


def test_import_writes_a_shardwise_copy_that_reads_back_equal(tmp_path):
    assert checkpoint_cli(["import", str(FIXTURES / "zero3"), str(tmp_path)]) == 0
    source, copy = open_checkpoint(FIXTURES / "zero3"), open_checkpoint(tmp_path)
    assert isinstance(copy, CheckpointReader) and copy.path == tmp_path / "global_step3"
    assert copy.meta["origin"] == "deepspeed" and copy.rng(0) is None
    for name in source.meta["params"]:
        assert copy.kinds(name) == source.kinds(name)
        for kind in source.kinds(name):
            assert torch.equal(copy.read_full(name, kind), source.read_full(name, kind)), (name, kind)
    for key in ("counters", "lr_scheduler", "client_state", "optimizer"):
        assert copy.meta[key] == source.meta[key], key
    assert checkpoint_cli(["import", str(tmp_path), str(tmp_path / "again")]) == 2  # already shardwise's


@pytest.mark.parametrize("case", STAGES)
def test_to_fp32_and_inspect_read_deepspeeds_folders(tmp_path, capsys, case):
    """`shardwise checkpoint to-fp32` on DeepSpeed's folder writes what DeepSpeed's own zero_to_fp32 does."""
    assert checkpoint_cli(["to-fp32", str(FIXTURES / case), str(tmp_path)]) == 0
    ours, theirs = load_file(str(tmp_path / "model.safetensors")), load_file(str(FIXTURES / case / "fp32.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    capsys.readouterr()
    assert checkpoint_cli(["inspect", str(FIXTURES / case)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == (f"{FIXTURES / case / 'global_step3'}: DeepSpeed 0.19.8 checkpoint, world size 2, ZeRO stage "
                          f"{STAGES[case]}, step 3 (shardwise loads it as it is)")
    assert any(line.split()[:3] == ["frozen.weight", "(24,", "24)"] and line.endswith("False     value")
               for line in printed)


def test_a_universal_checkpoint_reads_as_the_checkpoint_it_came_from():
    """DeepSpeed's ds_to_universal.py output of the ZeRO-2 checkpoint (`latest_universal` names it)."""
    universal, source = open_checkpoint(FIXTURES / "zero2_universal"), open_checkpoint(FIXTURES / "zero2")
    assert isinstance(universal, UniversalReader) and universal.path.name == "global_step3_universal"
    for name in source.meta["params"]:
        assert universal.kinds(name) == source.kinds(name)
        for kind in source.kinds(name):
            assert torch.equal(universal.read_full(name, kind), source.read_full(name, kind)), (name, kind)
    for key in ("counters", "lr_scheduler", "client_state", "loss_scaler", "optimizer", "stage", "world_size"):
        assert universal.meta[key] == source.meta[key], key
