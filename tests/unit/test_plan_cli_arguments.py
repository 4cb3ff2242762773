"""`shardwise plan`'s arguments: sizes below 1 are refused, a --model that is not a model factory is named as such,
and a tensor-parallel config is planned split, as the engine splits it (the engine's own figures are compared in
tests/distributed/test_plan_tensor_parallel.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.planner.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples" / "finetune_llm" / "tiny_llama")
CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _config(tmp_path: Path, **extra: object) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**CONFIG, **extra}))
    return str(path)


@pytest.mark.parametrize("flag, value", [("--seq_len", "0"), ("--seq_len", "-4"), ("--world", "0"), ("--world", "-1")])
def test_sizes_below_one_are_refused(flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--model", TINY, "--config", _config(tmp_path), flag, value])
    assert exit_.value.code == 2
    assert f"{flag}: at least 1; got {value}." in capsys.readouterr().err


@pytest.mark.parametrize("spec, args, said", [
    ("json:loads", [], "--model: json.loads() raised TypeError: "),
    ("json:loads", ["--model_arg", "s=x"], "--model: json.loads(s='x') raised JSONDecodeError: Expecting value"),
    ("json:dumps", ["--model_arg", "obj=1"], "--model: json.dumps(obj=1) returned a str, not an nn.Module"),
    ("json:nothing_here", [], "got 'json:nothing_here', but json has no 'nothing_here'"),
    ("no_such_package_xyz.mod:f", [], "got 'no_such_package_xyz.mod:f', whose module cannot be imported"),
])  # fmt: skip
def test_a_model_spec_that_is_no_model_factory_says_what_model_takes(
        spec: str, args: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", spec, *args, "--config", _config(tmp_path), "--seq_len", "8"]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "a Hugging Face config.json (or its directory), or 'package.module:factory' naming a callable that " \
           "returns an nn.Module" in err


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], world: int, **extra: object) -> dict:
    assert main(["--model", TINY, "--config", _config(tmp_path, **extra), "--world", str(world), "--seq_len", "64",
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tensor_parallel_is_planned_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    whole = _plan(tmp_path, capsys, 2)
    split = _plan(tmp_path, capsys, 2, tensor_parallel={"autotp_size": 2})
    assert split["ranks"] == {"world": 2, "tensor": 2, "pipe": 1, "data": 1, "sequence": 1}
    assert whole["ranks"] == {"world": 2, "tensor": 1, "pipe": 1, "data": 2, "sequence": 1}
    # every projection, the embedding and the LM head are split; only the norms stay whole
    assert split["model"]["trainable"] < 0.55 * whole["model"]["trainable"]
    assert split["parts"]["parameters"]["device"] < 0.55 * whole["parts"]["parameters"]["device"]
    assert split["activations"]["saved_bytes"] < whole["activations"]["saved_bytes"]
    assert split["peak_device"] < 0.7 * whole["peak_device"]


def test_a_world_the_tensor_parallel_size_does_not_divide_is_refused(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", TINY, "--config", _config(tmp_path, tensor_parallel={"autotp_size": 2}), "--world", "3",
                 "--seq_len", "8"]) == 2
    assert "does not divide the world size (3)" in capsys.readouterr().err


def test_sequence_parallelism_is_planned_on_a_rank_s_slice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """At sequence_parallel_size 2 over 2 processes: one sample per step (train_batch_size counts sequence groups),
    each rank tracing half of the 64 tokens, ZeRO partitioning over both ranks."""
    whole = _plan(tmp_path, capsys, 2, zero_optimization={"stage": 2})
    cut = _plan(tmp_path, capsys, 2, zero_optimization={"stage": 2}, sequence_parallel_size=2, train_batch_size=2)
    assert cut["ranks"] == {"world": 2, "tensor": 1, "pipe": 1, "data": 2, "sequence": 2}
    assert cut["activations"]["seq_len"] == 32 and whole["activations"]["seq_len"] == 64
    assert cut["activations"]["saved_bytes"] < 0.6 * whole["activations"]["saved_bytes"]
    assert cut["parts"]["optimizer_state"]["device"] == whole["parts"]["optimizer_state"]["device"]
    assert main(["--model", TINY, "--config", _config(tmp_path, sequence_parallel_size=2), "--world", "2",
                 "--seq_len", "63"]) == 2
    assert "cannot be cut into 2 equal slices" in capsys.readouterr().err
