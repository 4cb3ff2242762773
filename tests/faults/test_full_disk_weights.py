"""A full disk while writing whole weights: `engine.save_16bit_model` at ZeRO-3 (rank 0 writes, every rank must
end with the error, none waiting for rank 0) and the consolidation tools (`shardwise checkpoint to-fp32`,
`convert_zero_checkpoint_to_fp32_state_dict`): an error naming the file and the cause, and no temporary or
half-written output left behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardwise.checkpoint import cli
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.fp32 import convert_zero_checkpoint_to_fp32_state_dict
from tests.faults.checkpoint_models import error_of, tiny_engine, train_step
from tests.faults.tmpfs import PAGE, small_tmpfs
from tests.harness import run_distributed

NO_SPACE = r"{path}: no space left on device \(about \d+ bytes for this file, \d+ bytes free on that filesystem now\)"


def _save16(root: str) -> str:
    engine = tiny_engine(stage=3, zero={"stage3_gather_16bit_weights_on_model_save": True})
    train_step(engine)
    return error_of(engine.save_16bit_model, root, "model.safetensors")


def test_save_16bit_model_on_a_full_disk_fails_on_every_rank_naming_the_file(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "tiny", PAGE) as root:  # the file takes about 5 KiB
        messages = run_distributed(_save16, 2, str(root), timeout=60)
        assert messages[0] == messages[1], messages  # rank 1 ends with rank 0's error instead of waiting for it
        path = re.escape(str(root / "model.safetensors"))
        expected = (r"CheckpointError: save_16bit_model: rank 0 could not write the weights: "
                    + NO_SPACE.format(path=path) + r"; free space or save elsewhere\.")
        assert re.fullmatch(expected, messages[0]), messages[0]
        assert list(root.iterdir()) == []  # no .model.safetensors.partial


def _checkpoint(root: str) -> str:
    engine = tiny_engine()
    train_step(engine)
    return engine.save_checkpoint(root, tag="t")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    run_distributed(_checkpoint, 1, str(root))
    return root


def test_to_fp32_on_a_full_disk_names_the_file_and_leaves_nothing(saved: Path, tmp_path: Path, capsys) -> None:
    # About 4.2 KiB in the first of two shards, 0.9 KiB in the second: room for the first only.
    with small_tmpfs(tmp_path / "tiny", 2 * PAGE) as out:
        assert cli.main(["to-fp32", str(saved), str(out), "--max-shard-size", "4500"]) == 2
        err = capsys.readouterr().err
        second = re.escape(str(out / "model-00002-of-00002.safetensors"))
        expected = (r"shardwise checkpoint: error: " + NO_SPACE.format(path=second) + r"; free space or save "
                    r"elsewhere\. No file of this conversion was left in " + re.escape(str(out))
                    + r" \(model-00001-of-00002\.safetensors, already written, was removed\)\.\n")
        assert re.fullmatch(expected, err), err
        assert list(out.iterdir()) == []


def test_pickle_conversion_on_a_full_disk_names_the_file_and_leaves_nothing(saved: Path, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "tiny", PAGE) as out:
        with pytest.raises(CheckpointError) as raised:
            convert_zero_checkpoint_to_fp32_state_dict(saved, out)
        expected = (NO_SPACE.format(path=re.escape(str(out / "pytorch_model.bin"))) + r"; free space or save "
                    r"elsewhere\. No file of this conversion was left in " + re.escape(str(out)) + r"\.")
        assert re.fullmatch(expected, str(raised.value)), str(raised.value)
        assert list(out.iterdir()) == []
