"""Broken checkpoint files: each is a CheckpointError that names the file and what is wrong.

Truncated, bit-flipped, junk and foreign files, manifests that are corrupt or from another format
version, a missing rank file, and a full disk while saving. "+ manifest" cases rewrite the manifest's
size and checksum to match the broken file (a file replaced together with its manifest, or a copy tool
that rewrote both), so that the file reader itself must notice, not only the checksum.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

from shardwise.checkpoint import cli, layout
from tests.faults.checkpoint_models import NO_SPACE, error_of, tiny_engine, train_step
from tests.faults.tmpfs import bytes_on_tmpfs, small_tmpfs
from tests.harness import run_distributed

TAG = "t"


def _save(root: str, tags: tuple[str, ...] = (TAG,)) -> list[str]:
    engine = tiny_engine()
    train_step(engine)
    return [error_of(engine.save_checkpoint, root, tag=tag) if i else engine.save_checkpoint(root, tag=tag)
            for i, tag in enumerate(tags)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint saved at world size 2 (both rank files hold pieces), never modified."""
    root = tmp_path_factory.mktemp("saved")
    run_distributed(_save, 2, str(root))
    return root


def _rank_file(root: Path, rank: int = 0) -> Path:
    return root / TAG / f"rank{rank}.safetensors"


def _match_manifest(root: Path) -> None:
    """Record each rank file's present size and checksum in the manifest."""
    manifest = root / TAG / "manifest.json"
    meta = json.loads(manifest.read_text())
    for name in meta["files"]:
        path = root / TAG / name
        meta["files"][name] = {"bytes": path.stat().st_size, "crc32": layout.crc32_of(path)}
    manifest.write_text(json.dumps(meta))


def _edit_manifest(root: Path, edit: Callable[[dict], object]) -> None:
    manifest = root / TAG / "manifest.json"
    meta = json.loads(manifest.read_text())
    edit(meta)  # in place
    manifest.write_text(json.dumps(meta))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x80
    path.write_bytes(bytes(data))


def _junk(root: Path) -> None:
    _rank_file(root).write_bytes(bytes(range(256)) * 20)


def _foreign(root: Path) -> None:
    save_file({"model.weight": torch.zeros(3, 3)}, str(_rank_file(root)))


CASES: dict[str, tuple[Callable[[Path], None], bool, str]] = {
    # name: (break it, then match the manifest?, the message after the checkpoint's path)
    "truncated": (lambda r: _rank_file(r).write_bytes(_rank_file(r).read_bytes()[:-100]), False,
                  "t/rank0.safetensors: size or checksum differs from the manifest; the file is corrupt or truncated."),
    "truncated + manifest": (lambda r: _rank_file(r).write_bytes(_rank_file(r).read_bytes()[:-100]), True,
                             "t/rank0.safetensors: tensor '"),
    "bit-flipped data": (lambda r: _flip(_rank_file(r), -3), False,
                         "t/rank0.safetensors: size or checksum differs from the manifest"),
    "bit-flipped header + manifest": (lambda r: _flip(_rank_file(r), 20), True,
                                      "t/rank0.safetensors: its header is not valid JSON ("),
    "junk + manifest": (_junk, True, "t/rank0.safetensors: its header claims 506097522914230528 bytes but the "
                                     "file has 5120; it is not a safetensors file, or it is truncated or corrupt."),
    "empty + manifest": (lambda r: _rank_file(r).write_bytes(b""), True,
                         "t/rank0.safetensors: 0 bytes long, shorter than the 8-byte header length; it is not a "
                         "safetensors file, or it is truncated or corrupt."),
    "foreign safetensors + manifest": (_foreign, True, "t/rank0.safetensors: has no tensor '"),
    "missing rank file": (lambda r: _rank_file(r, 1).unlink(), False,
                          "t/rank1.safetensors: missing from the checkpoint."),
    "junk manifest": (lambda r: (r / TAG / "manifest.json").write_bytes(bytes(range(128, 256))), False,
                      "t/manifest.json: not valid JSON ('utf-8' codec can't decode byte 0x80 in position 0: invalid "
                      "start byte); the manifest is corrupt or not a shardwise manifest."),
    "another format version": (lambda r: _edit_manifest(r, lambda m: m.update(format_version=1)), False,
                               "t/manifest.json: format_version 1, this shardwise reads 2; it was written by an "
                               "incompatible shardwise version."),
    "not a shardwise manifest": (lambda r: (r / TAG / "manifest.json").write_text("[1, 2]"), False,
                                 "t/manifest.json: has no format_version; it is not a shardwise checkpoint manifest."),
    "manifest without files": (lambda r: _edit_manifest(r, lambda m: m.pop("files")), False,
                               "t/manifest.json: inconsistent ('files' missing or not dict); the manifest is corrupt "
                               "or was edited."),
    "junk latest": (lambda r: (r / "latest").write_bytes(b"\xff\xfe"), False,
                    "latest: not text; it should hold the name of a tag directory in "),
}


def _load_each(roots: list[str]) -> list[str]:
    engine = tiny_engine()
    return [error_of(engine.load_checkpoint, root) for root in roots]


def _load(root: str) -> str:
    return tiny_engine().load_checkpoint(root)[0]


def _broken_copies(saved: Path, tmp_path: Path) -> list[Path]:
    roots = []
    for i, (name, (breaks, match, _)) in enumerate(CASES.items()):
        root = tmp_path / f"case{i}"
        shutil.copytree(saved, root)
        breaks(root)
        if match:
            _match_manifest(root)
        roots.append(root)
    return roots


def test_every_broken_file_is_a_checkpoint_error_naming_it(saved: Path, tmp_path: Path, capsys) -> None:
    roots = _broken_copies(saved, tmp_path)
    loaded = run_distributed(_load_each, 1, [str(r) for r in roots])[0]
    for (name, (_, _, expected)), root, message in zip(CASES.items(), roots, loaded):
        assert message.startswith(f"CheckpointError: {root}/{expected}"), f"{name}: {message}"
        # the consolidation tool reads the same files: the same message, exit status 2, no traceback
        assert cli.main(["to-fp32", str(root), str(tmp_path / "out")]) == 2, name
        assert capsys.readouterr().err.startswith(f"shardwise checkpoint: error: {root}/{expected}"), name


def test_the_unbroken_checkpoint_loads(saved: Path, tmp_path: Path) -> None:
    """The other half of the test above: the same load succeeds on the files as saved."""
    assert run_distributed(_load, 1, str(saved)) == [str(saved / TAG)]


def test_full_disk_names_the_file_and_the_bytes_and_keeps_latest(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run_distributed(_save, 2, str(reference))
    one = bytes_on_tmpfs(reference)
    with small_tmpfs(tmp_path / "tiny", one + one // 2) as root:  # room for one checkpoint, not two
        (first, message), rank1 = run_distributed(_save, 2, str(root), ("first", "second"))
        assert first == str(root / "first")
        assert rank1 == [first, message]  # the same error on every rank, whichever rank ran out of space
        assert message.startswith(f"CheckpointError: save_checkpoint: tag 'second' in {root} was not saved: rank "), message
        assert re.search(NO_SPACE.format(root=re.escape(str(root))), message), message
        assert message.endswith("`latest` names 'first'.")
        assert sorted(p.name for p in root.iterdir()) == ["first", "latest"]  # no .second.partial left
        assert run_distributed(_load, 2, str(root)) == [str(root / "first")] * 2
