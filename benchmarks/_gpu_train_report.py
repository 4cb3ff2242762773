"""benchmarks/gpu_train.py's report: provenance, each config's figures (tokens/s, MFU, peak memory), the losses
compared across configs, the ratios, a table for the log, and where the JSON goes."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from _gpu_train_model import Shape

REPO = Path(__file__).resolve().parent.parent

FIRST_LOSS_TOLERANCE = {True: 1e-2, False: 1e-4}
"""Relative agreement of every config's first loss with the floor's, by bf16 on/off. All start from one seed and
one batch, so the first forward computes the same function; under bf16 the floor keeps an fp32 residual stream
(autocast over fp32 parameters) where the libraries' bf16 modules add in bf16, which moves a loss near ln(32000)
by ~1e-3 relative. A config beyond the tolerance computes something else."""
DIVERGENCE = 2e-2
"""A config whose loss moves this far (relative) from the floor's within the few steps on one repeated batch
learns differently (another update rule, precision or clipping), beyond the rounding of bf16."""


def commit() -> dict[str, Any]:
    """The tree's commit: git where .git came along, else $SHARDWISE_COMMIT, else the stamp
    tools/fetch_device_wheels.sh writes into .whl/commit.txt (the device machine gets the tree without .git, and
    .whl with it)."""
    try:
        if (REPO / ".git").exists():  # else git would answer for whatever repository holds this folder
            head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "benchmarks"], cwd=REPO,
                                   capture_output=True, text=True, check=True).stdout.strip()
            return {"commit": head.stdout.strip(), "commit_from": "git", "source_dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        pass
    if os.environ.get("SHARDWISE_COMMIT"):
        return {"commit": os.environ["SHARDWISE_COMMIT"], "commit_from": "SHARDWISE_COMMIT"}
    marker = REPO / ".whl" / "commit.txt"
    if marker.exists():
        return {"commit": marker.read_text().strip(), "commit_from": ".whl/commit.txt"}
    return {"commit": None, "commit_from": "unknown: no .git, SHARDWISE_COMMIT or .whl/commit.txt"}


def environment(probe: dict[str, Any]) -> dict[str, Any]:
    keys = ("device", "device_memory_bytes", "capability", "torch", "cuda", "python", "cpus")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **commit(),
            **{k: probe.get(k) for k in keys}}


def _figures(r: dict[str, Any], tokens: int, flops: float, measured: float, peak: float | None) -> None:
    median = statistics.median(r["step_seconds"])
    r.update(median_step_seconds=round(median, 4), step_seconds_min=round(min(r["step_seconds"]), 4),
             step_seconds_max=round(max(r["step_seconds"]), 4),
             spread=round((max(r["step_seconds"]) - min(r["step_seconds"])) / median, 3),
             tokens_per_second=round(tokens / median, 1),
             mfu_vs_measured=round(flops / median / (measured * 1e12), 4),
             mfu_vs_spec=round(flops / median / (peak * 1e12), 4) if peak else None)


def _relative(a: float, b: float) -> float:
    return round(abs(a - b) / abs(b), 6)


def _losses_against(r: dict[str, Any], other: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """First-loss agreement and the largest relative gap over the steps both ran (the offloaded configs run
    fewer timed steps)."""
    common = min(len(r["losses"]), len(other["losses"]))
    gaps = [_relative(a, b) for a, b in zip(r["losses"][:common], other["losses"][:common])]
    return {"first": gaps[0], "max": max(gaps), "at_step": gaps.index(max(gaps)) + 1,
            "first_agrees": gaps[0] <= tolerance}


def summarize(results: list[dict[str, Any]], shape: Shape, spec: dict[str, Any], measured: float,
              peak: float | None) -> dict[str, Any]:
    """Adds each ok config's figures in place; returns the ratios and the loss comparison."""
    tokens = spec["micro"] * spec["seq"]
    flops = shape.flops_per_token(spec["seq"]) * tokens
    ok = {r["config"]: r for r in results if r["status"] == "ok"}
    for r in ok.values():
        _figures(r, tokens, flops, measured, peak)
    tolerance = FIRST_LOSS_TOLERANCE[spec["bf16"]]
    ratios: dict[str, Any] = {}
    losses: dict[str, Any] = {"first_loss_tolerance": tolerance, "vs_floor": {}, "shardwise_vs_deepspeed": {}}
    floor = ok.get("floor")
    for name, r in ok.items():
        if floor and name != "floor":
            ratios[f"{name} / floor"] = _ratio(r, floor)
            losses["vs_floor"][name] = _losses_against(r, floor, tolerance)
        peer = ok.get(name.replace("shardwise", "deepspeed")) if name.startswith("shardwise") else None
        if peer:
            ratios[f"{name} / {peer['config']}"] = _ratio(r, peer)
            losses["shardwise_vs_deepspeed"][name] = _losses_against(r, peer, tolerance)
    disagree = sorted(n for n, c in losses["vs_floor"].items() if not c["first_agrees"])
    losses["configs_whose_first_loss_disagrees"] = disagree
    losses["divergence_threshold"] = DIVERGENCE
    losses["configs_diverging_from_floor"] = sorted(n for n, c in losses["vs_floor"].items()
                                                    if c["max"] > DIVERGENCE)
    return {"ratios": ratios, "losses": losses}


def _ratio(r: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Throughput (above 1: this config is faster) and peak memory (below 1: it holds less)."""
    return {"throughput": round(r["tokens_per_second"] / base["tokens_per_second"], 3),
            "peak_memory": round(r["peak_memory_bytes"] / base["peak_memory_bytes"], 3)}


def table(results: list[dict[str, Any]]) -> list[str]:
    rows = [f"{'config':<22}{'status':<9}{'step s':>8}{'tok/s':>10}{'MFU meas':>9}{'MFU spec':>9}{'peak GiB':>9}"
            f"{'loss 1':>9}{'loss n':>9}  optimizer"]
    for r in results:
        if r["status"] != "ok":
            rows.append(f"{r['config']:<22}{r['status']:<9}{(r.get('reason') or '')[:80]}")
            continue
        spec_mfu = f"{r['mfu_vs_spec']:.3f}" if r["mfu_vs_spec"] is not None else "-"
        rows.append(f"{r['config']:<22}{'ok':<9}{r['median_step_seconds']:>8.3f}{r['tokens_per_second']:>10.0f}"
                    f"{r['mfu_vs_measured']:>9.3f}{spec_mfu:>9}{r['peak_memory_bytes'] / 2**30:>9.2f}"
                    f"{r['losses'][0]:>9.4f}{r['losses'][-1]:>9.4f}  {r['optimizer'].rsplit('.', 1)[-1]}")
    return rows


def write(report: dict[str, Any], name: str, tiny: bool, out: str | None) -> Path:
    """--out; else $OUT on the device machine; else benchmarks/results/gpu/<name>-<date>.json (a --tiny run's
    figures are no result: runs/gpu_train/, ignored by git)."""
    if out:
        path = Path(out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"{name}.json"
    else:
        folder = REPO / "runs" / "gpu_train" if tiny else REPO / "benchmarks" / "results" / "gpu"
        path = folder / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
