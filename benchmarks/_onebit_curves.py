"""`onebit.py`'s loss curves: the README's demo (examples/demo/train.py: the 1.85M-parameter byte-level GPT
on the bundled King James text, 2 processes, its ds_config.json) once per optimizer, and one PNG of their
training losses drawn by `shardwise plot`.

Each run is the demo as `make demo` starts it (`shardwise --num_gpus 2 examples/demo/train.py`: gloo on
localhost, no namespaces), with its config changed in three places only: the optimizer (the demo's AdamW
params, plus each 1-bit optimizer's own keys), `steps_per_print` 10 (so the CSV monitor writes rank 0's mean
training loss over every 10 steps) and `csv_monitor` on. The demo prints the validation loss (4 fixed
batches) every `--eval_interval` steps and at the end; those lines are parsed from its output.

For the PNG each run's `Train_Samples_train_loss.csv` is copied into one folder with its column renamed
`train_loss_<optimizer>`, so `shardwise plot` draws them as curves of one panel (x: samples, 32 per step).
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import REPO_ROOT, free_port, log

DEMO = REPO_ROOT / "examples" / "demo"
LOSS_CSV = "Train_Samples_train_loss.csv"
VALIDATION = re.compile(r"step\s+(\d+): validation loss ([0-9.]+)")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]),
            "TORCH_CPP_LOG_LEVEL": "ERROR", "DS_ACCELERATOR": "cpu"}


def demo_config(optimizer: dict[str, Any], runs: Path, name: str) -> dict[str, Any]:
    config = json.loads((DEMO / "ds_config.json").read_text())
    config["optimizer"] = optimizer
    config["steps_per_print"] = 10
    config["csv_monitor"] = {"enabled": True, "output_path": str(runs), "job_name": name}
    return config


def run_demo(name: str, optimizer: dict[str, Any], root: Path, steps: int, eval_interval: int,
             timeout: float) -> dict[str, Any]:
    """One demo run; its validation losses, the CSV's training losses, or {"error": ...} with the output's tail."""
    config_path = root / f"{name}.json"
    config_path.write_text(json.dumps(demo_config(optimizer, root / "runs", name)))
    cmd = [sys.executable, "-m", "shardwise.cli", "--num_gpus", "2", "--master_port", str(free_port()),
           str(DEMO / "train.py"), "--config", str(config_path), "--steps", str(steps),
           "--eval_interval", str(eval_interval), "--save_dir", str(root / "checkpoints" / name), "--sample_bytes", "0"]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout:.0f} s", "output_tail": str(e.stdout or "")[-2000:]}
    output = done.stdout + done.stderr
    wall = round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        return {"error": _first_error(output) or f"exit code {done.returncode}", "output_tail": output[-1500:],
                "wall_s": wall}
    csv_path = root / "runs" / name / LOSS_CSV
    with csv_path.open(newline="") as f:
        rows = list(csv.reader(f))[1:]
    batch = config_batch(config_path)
    return {"optimizer": optimizer, "wall_s": wall,
            "validation_loss": {int(s): float(v) for s, v in VALIDATION.findall(output)},
            "train_loss_mean10": {int(float(s)) // batch: round(float(v), 5) for s, v in rows}}


def config_batch(config_path: Path) -> int:
    """Samples per optimizer step (the CSV's x axis counts samples): micro-batch x accumulation x 2 ranks."""
    config = json.loads(config_path.read_text())
    return config["train_micro_batch_size_per_gpu"] * config.get("gradient_accumulation_steps", 1) * 2


def _first_error(output: str) -> str | None:
    for line in output.splitlines():
        if re.search(r"\b\w*(Error|Exception)\b:", line):
            return line.strip()[:600]
    return None


def final_figures(runs: dict[str, dict[str, Any]], baseline_of: dict[str, str], tail: int = 3) -> None:
    """Per run: the last validation loss, the mean of the last `tail` training-loss points (each a 10-step
    mean), and both over the baseline's."""
    for row in runs.values():
        if "error" in row:
            continue
        row["final_validation_loss"] = row["validation_loss"][max(row["validation_loss"])]
        row["final_train_loss"] = round(statistics.fmean(list(row["train_loss_mean10"].values())[-tail:]), 5)
    for name, row in runs.items():
        base = runs.get(baseline_of.get(name, ""))
        if "error" in row or not base or "error" in base:
            continue
        row["vs_baseline"] = {"baseline": baseline_of[name],
                              "final_validation_loss_ratio": round(row["final_validation_loss"] / base["final_validation_loss"], 4),
                              "final_train_loss_ratio": round(row["final_train_loss"] / base["final_train_loss"], 4)}


def plot_curves(runs: dict[str, dict[str, Any]], root: Path, png: Path) -> str:
    """One folder of renamed CSVs, drawn by `shardwise plot` into `png`; returns what the command said."""
    title = "demo at world 2: rank 0's training loss, mean of 10 steps"  # the PNG's title: the folder, as passed
    folder = root / title
    folder.mkdir(exist_ok=True)
    for name, row in runs.items():
        if "error" in row:
            continue
        with (root / "runs" / name / LOSS_CSV).open(newline="") as f:
            rows = list(csv.reader(f))
        with (folder / f"Train_Samples_train_loss_{name}.csv").open("w", newline="") as f:
            csv.writer(f).writerows([["step", f"train_loss_{name}"], *rows[1:]])
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "plot", title, "-o", str(png.resolve())],
                          cwd=root, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    return (done.stdout + done.stderr).strip()


def run_curves(optimizers: dict[str, dict[str, Any]], baseline_of: dict[str, str], root: Path, steps: int,
               eval_interval: int, png: Path, timeout: float) -> dict[str, Any]:
    runs = {}
    for name, optimizer in optimizers.items():
        runs[name] = run_demo(name, optimizer, root, steps, eval_interval, timeout)
        outcome = runs[name].get("error", "")[:100] or f"validation loss {runs[name]['validation_loss']}"
        log(f"[demo {name}] {outcome} (run: {runs[name].get('wall_s')} s)")
    final_figures(runs, baseline_of)
    return {"runs": runs, "plot": plot_curves(runs, root, png)}
