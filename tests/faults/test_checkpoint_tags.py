"""Checkpoint tags and `latest`: one directory name inside the save directory, the same on every rank.

A tag such as "../x" used to write outside `save_dir` and, when the target existed, delete it; ranks with
different tags crashed in a `.partial` path. Bad tags are now refused on every rank before anything is
written, and `latest` (or a load tag) that names a path is refused, never followed.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from shardwise.checkpoint import cli
from tests.faults.checkpoint_models import error_of, tiny_engine, train_step
from tests.harness import run_distributed

ALPHABET = "one directory name of ASCII letters, digits and . _ - + = @, not starting with '.'"


def _bad_tags(root: str, victim: str) -> list[str]:
    engine = tiny_engine()
    train_step(engine)
    tags = ["../victim", victim, "", ".", "..", "a/b", "a\0b", "a\nb", ".hidden", "x" * 201, "latest"]
    return [error_of(engine.save_checkpoint, root, tag=tag) for tag in tags]


def test_bad_tags_are_refused_on_every_rank_and_nothing_is_written_or_removed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("keep me")
    root = tmp_path / "ckpt"
    per_rank = run_distributed(_bad_tags, 2, str(root), str(victim))
    assert per_rank[0] == per_rank[1]  # the same error on every rank, none left waiting
    for tag, message in zip(["../victim", str(victim), "", ".", "..", "a/b", "a\0b", "a\nb", ".hidden", "x" * 201],
                            per_rank[0]):
        assert message == (f"CheckpointError: save_checkpoint: tag must be {ALPHABET}, at most 200 characters, not "
                           f"'latest'; got {tag!r}. Nothing was written."), message
    assert "'latest' is the file that names the newest tag" in per_rank[0][-1]
    assert (victim / "data.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no save_dir, no .partial anywhere


def _good_tags(root: str) -> list[str]:
    engine = tiny_engine()
    train_step(engine)
    saved = []
    for tag in ["v1.0", "run-3+seed=7@host", "global_step10", "_x"]:
        engine.save_checkpoint(root, tag=tag)
        saved.append(Path(root, "latest").read_text())
    return saved


def test_tags_of_the_allowed_alphabet_save(tmp_path: Path) -> None:
    assert run_distributed(_good_tags, 1, str(tmp_path))[0] == ["v1.0", "run-3+seed=7@host", "global_step10", "_x"]


def _over_existing(root: str) -> list[str]:
    engine = tiny_engine()
    return [error_of(engine.save_checkpoint, root, tag=tag) for tag in ("data", "notes.txt", "link")]


def test_an_existing_directory_file_or_link_that_is_not_a_checkpoint_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_text("keep me")
    (tmp_path / "notes.txt").write_text("keep me too")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "f").write_text("x")
    (tmp_path / "link").symlink_to(outside)
    messages = run_distributed(_over_existing, 1, str(tmp_path))[0]
    for tag, message in zip(("data", "notes.txt", "link"), messages):
        assert message == (f"CheckpointError: save_checkpoint: {tmp_path / tag} exists and is not a shardwise "
                           "checkpoint, so it is left alone; choose another tag or save_dir."), message
    assert (tmp_path / "data" / "train.bin").read_text() == "keep me"
    assert (tmp_path / "notes.txt").read_text() == "keep me too"
    assert (outside / "f").read_text() == "x" and (tmp_path / "link").is_symlink()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def _save(root: str, tag: str) -> None:
    engine = tiny_engine()
    train_step(engine)
    engine.save_checkpoint(root, tag=tag)


def _load_errors(root: str, tags: list[str | None]) -> list[str]:
    engine = tiny_engine()
    return [error_of(engine.load_checkpoint, root, tag=tag) for tag in tags]


def test_latest_or_a_load_tag_naming_a_path_is_refused_not_followed(tmp_path: Path, capsys) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    run_distributed(_save, 1, str(root), "mine")
    run_distributed(_save, 1, str(outside), "theirs")  # a complete checkpoint that a path could reach
    for named in ("../outside/theirs", str(outside / "theirs")):
        (root / "latest").write_text(named)
        message = run_distributed(_load_errors, 1, str(root), [None])[0][0]
        assert message == (f"CheckpointError: {root / 'latest'}: names {named!r}, but it must name a tag directory "
                           f"inside {root} (one directory name: no '/', '..', NUL or newline); it was not followed. "
                           "Pass tag= or write a tag name into it."), message
        assert cli.main(["to-fp32", str(root), str(tmp_path / "out")]) == 2
        assert "it was not followed" in capsys.readouterr().err
    messages = run_distributed(_load_errors, 1, str(root), ["../outside/theirs", "..", ""])[0]
    for tag, message in zip(["../outside/theirs", "..", ""], messages):
        assert message == (f"CheckpointError: load_checkpoint: tag must be one directory name (no '/', '..', NUL or "
                           f"newline) inside {root}; got {tag!r}."), message


def _differing(root: str, validation: str | None, tags: tuple[str, str] = ("t0", "t1")) -> str:
    config = {"checkpoint": {"tag_validation": validation}} if validation else {}
    engine = tiny_engine(**config)
    train_step(engine)
    tag = tags[dist.get_rank()]
    try:
        return engine.save_checkpoint(root, tag=tag)
    except Exception as e:  # noqa: BLE001 - the test asserts the message
        return f"{type(e).__name__}: {e}"


def test_differing_tags_are_an_error_on_every_rank_naming_each_ranks_tag(tmp_path: Path) -> None:
    for validation in (None, "Warn", "Fail"):  # None: the default, "Warn" as in DeepSpeed
        root = tmp_path / str(validation)
        per_rank = run_distributed(_differing, 2, str(root), validation)
        assert per_rank[0] == per_rank[1], per_rank
        assert per_rank[0].startswith("CheckpointError: save_checkpoint: every rank must pass the same tag; got "
                                      "rank 0: 't0', rank 1: 't1'. Each rank writes its own file into the tag's "
                                      "directory, so differing tags cannot make a checkpoint (DeepSpeed's "
                                      "tag_validation \"Warn\" is therefore an error here too"), per_rank[0]
        assert not root.exists()


def test_a_bad_tag_on_one_rank_is_an_error_on_every_rank(tmp_path: Path) -> None:
    per_rank = run_distributed(_differing, 2, str(tmp_path), None, ("good", "../x"))
    assert per_rank == [f"CheckpointError: save_checkpoint: tag rank 1: must be {ALPHABET}, at most 200 characters, "
                        "not 'latest'; got '../x'. Nothing was written."] * 2
    assert not tmp_path.joinpath("good").exists() and not tmp_path.parent.joinpath("x").exists()


def _load(root: str) -> str:
    return tiny_engine().load_checkpoint(root)[0]


def test_ignore_saves_under_rank_0s_tag(tmp_path: Path) -> None:
    assert run_distributed(_differing, 2, str(tmp_path), "Ignore") == [str(tmp_path / "t0")] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t0"]
    assert sorted(p.name for p in (tmp_path / "t0").iterdir()) == ["manifest.json", "rank0.safetensors",
                                                                    "rank1.safetensors"]
    assert run_distributed(_load, 2, str(tmp_path)) == [str(tmp_path / "t0")] * 2
