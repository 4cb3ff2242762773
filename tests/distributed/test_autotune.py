"""`shardwise autotune` for real: the in-process side of an experiment (autotune/trial.py) on 2 gloo ranks, and
the whole command (`--autotuning run`) on the demo script: profile, search, results, resume, train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
SHARDWISE = [sys.executable, "-m", "shardwise.cli"]


def _experiment(autotuning: dict[str, Any], steps: int) -> dict[str, Any]:
    """Train until the trial stops the run; the step it stopped after and what rank 0 wrote."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import shardwise
    from examples.demo.model import from_preset

    torch.manual_seed(0)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "autotuning": {"enabled": True, **autotuning}}
    engine, *_ = shardwise.initialize(model=from_preset("demo", seq_len=32), config=config)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps * 2):
            x, y = (torch.randint(0, 256, (2, 32), generator=g) for _ in range(2))
            engine.backward(engine(x, y))
            engine.step()
    except SystemExit as stop:
        path = Path(autotuning.get("metric_path") or autotuning.get("model_info_path"))
        return {"code": stop.code, "step": engine.global_steps, "report": json.loads(path.read_text())}
    return {"code": None, "step": engine.global_steps}


def test_an_experiment_reports_its_figures_and_stops_after_the_timed_steps(tmp_path: Path) -> None:
    metrics = str(tmp_path / "metrics.json")
    ranks = run_distributed(_experiment, 2, {"metric_path": metrics, "start_profile_step": 3, "end_profile_step": 4},
                            9, timeout=120)
    assert [r["step"] for r in ranks] == [4, 4] and ranks[0]["code"] == 0
    report = ranks[0]["report"]
    assert report["status"] == "ok" and report["timed_steps"] == 2
    assert report["throughput"] * report["latency"] / 1e3 == pytest.approx(8)  # samples per step over seconds per step
    assert 0.9 < report["planned_peak"] / report["peak_memory"] < 1.1 and report["FLOPS_per_gpu"] > 0


def test_an_experiment_over_its_memory_budget_stops_at_step_two(tmp_path: Path) -> None:
    metrics = str(tmp_path / "metrics.json")
    ranks = run_distributed(_experiment, 2, {"metric_path": metrics, "memory_per_rank": 1024}, 9, timeout=120)
    assert [r["step"] for r in ranks] == [2, 2]
    assert ranks[0]["report"]["status"] == "over_budget" and ranks[0]["report"]["peak_memory"] > 1024


def test_a_hopeless_experiment_stops_after_its_first_timed_step(tmp_path: Path) -> None:
    metrics = str(tmp_path / "metrics.json")
    ranks = run_distributed(_experiment, 2, {"metric_path": metrics, "stop_below": 1e12}, 9, timeout=120)
    assert [r["step"] for r in ranks] == [3, 3]
    assert ranks[0]["report"]["status"] == "hopeless" and ranks[0]["report"]["throughput"] < 1e12


def test_the_profiling_run_writes_the_planners_inputs_after_step_one(tmp_path: Path) -> None:
    info = str(tmp_path / "model_info.json")
    ranks = run_distributed(_experiment, 2, {"model_info": {"profile": True}, "model_info_path": info}, 9, timeout=120)
    assert [r["step"] for r in ranks] == [1, 1]
    report = ranks[0]["report"]
    from examples.demo.model import from_preset

    assert report["shape"]["trainable"] == sum(p.numel() for p in from_preset("demo", seq_len=32).parameters())
    assert report["activations"]["micro_batch"] == 2 and report["activations"]["saved_bytes"] > 0
    assert report["capacity_per_rank"] > 0 and report["device"] == "cpu" and report["dp_size"] == 2


def _autotune(cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    command = [*SHARDWISE, *flags, "--num_gpus", "2", str(REPO / "examples/demo/train.py"), "--deepspeed_config",
               "ds.json", "--steps", "6", "--seq_len", "32", "--save_dir", str(cwd / "ckpt"), "--sample_bytes", "8"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.usefixtures("zygote_ranks")
def test_autotuning_run_searches_writes_its_results_resumes_and_trains(tmp_path: Path) -> None:
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": [0, 2], "offload_optimizer": {"device": "none"}},
              "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 4}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    done = _autotune(tmp_path, "--autotuning", "run")
    assert done.returncode == 0, done.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    table = json.loads((results / "results.json").read_text())
    ran = [e for e in table["experiments"] if e["status"] == "ok"]
    assert ran and all(e["planned"] and e["measured"] for e in ran)
    assert all(abs(e["planned"] / e["measured"] - 1) < 0.15 for e in ran)
    best = max(ran, key=lambda e: e["metric"])
    assert table["best"] == best["name"]
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["train_batch_size"] == 8 and "autotuning" not in optimal
    assert (results / "throughput_vs_memory.png").stat().st_size > 10_000
    assert (results / "cmd_optimal.txt").read_text().startswith("shardwise --num_gpus 2 ")
    assert "checkpoint saved to" in done.stdout  # `run` went on to train with the best config
    assert f"[autotune] best: {best['name']}" in done.stdout
    # an interrupted search: one experiment had not finished; the rerun runs it alone and takes the rest
    unfinished = ran[0]["name"]
    (results / unfinished / "result.json").unlink()
    resumed = subprocess.run([*SHARDWISE, "autotune", "--num_gpus", "2", str(REPO / "examples/demo/train.py"),
                              "--deepspeed_config", "ds.json", "--steps", "6", "--seq_len", "32"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    running = [line for line in resumed.stdout.splitlines() if line.endswith(": running") or ": running (" in line]
    assert len(running) == 1 and unfinished in running[0], resumed.stdout
    assert resumed.stdout.count("(from an earlier run)") >= len(ran) - 1
