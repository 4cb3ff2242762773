"""What a search leaves in `results_dir`: DeepSpeed's `summary.txt`, `ds_config_optimal.json` and
`cmd_optimal.txt`, and shardwise's `results.json` (every candidate: its fate, planned and measured peaks,
figures, seconds) and `throughput_vs_memory.png`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from ..profiling.table import render_table
from ..profiling.units import binary_bytes
from .search import Outcome
from .trial import OK, write_json


def summary(outcomes: Sequence[Outcome], best: Outcome | None, metric: str, seconds: float) -> str:
    per_stage = []
    for stage in sorted({o.candidate.stage for o in outcomes}):
        ran = [o for o in outcomes if o.candidate.stage == stage and o.ran]
        good = [o for o in ran if o.status == OK and o.metric is not None]
        top = _best_of(good, metric)
        per_stage.append([f"z{stage}", len(ran), _number(top.metric) if top else "", top.candidate.name if top else ""])
    ran = [o for o in outcomes if o.ran]
    per_stage.append(["global", len(ran), _number(best.metric) if best else "", best.candidate.name if best else ""])
    head = render_table("Autotuning", ["tuning_space", "num_exps", f"best_{metric}", "best_exp_name"], per_stage)
    rows = [[o.candidate.name, o.status, _bytes(o.planned), _bytes(o.measured), _number(o.metric),
             f"{o.seconds:.1f}" + (" (earlier run)" if o.resumed else ""), o.reason] for o in outcomes]
    detail = render_table("Experiments", ["name", "status", "planned peak", "measured peak", metric, "seconds",
                                          "why"], rows, right_from=2, right_until=6)
    measured = sum(o.seconds for o in outcomes if o.ran and not o.resumed)
    tail = (f"Tuning completed in {seconds:.1f} s ({measured:.1f} s in {sum(o.ran and not o.resumed for o in outcomes)} "
            f"experiments run now, {sum(o.resumed for o in outcomes)} taken from an earlier run). "
            f"Total number of experiments: {len(ran)}; planned away without running: {len(outcomes) - len(ran)}.")
    return f"{head}\n\n{detail}\n\n{tail}"


def write_results(results_dir: Path, outcomes: Sequence[Outcome], best: Outcome | None, metric: str, seconds: float,
                  optimal_config: dict[str, Any] | None, optimal_command: list[str] | None, budget: int | None) -> str:
    text = summary(outcomes, best, metric, seconds)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "summary.txt").write_text(text + "\n")
    write_json(results_dir / "results.json", {
        "metric": metric, "budget_per_rank": budget, "seconds": seconds,
        "best": best.candidate.name if best else None,
        "experiments": [dataclasses.asdict(o) | {"name": o.candidate.name} for o in outcomes]})
    if optimal_config is not None and optimal_command is not None:
        (results_dir / "ds_config_optimal.json").write_text(json.dumps(optimal_config, indent=2) + "\n")
        (results_dir / "cmd_optimal.txt").write_text(" ".join(optimal_command) + "\n")
    plot(results_dir / "throughput_vs_memory.png", outcomes, best, metric, budget)
    return text


def plot(path: Path, outcomes: Sequence[Outcome], best: Outcome | None, metric: str, budget: int | None) -> None:
    """Each measured candidate at its peak memory and metric, by stage; pruned ones as ticks at their planned
    peak; the budget as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    mib = 2.0**20
    for stage in sorted({o.candidate.stage for o in outcomes}):
        good = [o for o in outcomes if o.candidate.stage == stage and o.status == OK and o.metric is not None]
        xs = [(o.measured or o.planned or 0) / mib for o in good]
        ax.scatter(xs, [o.metric for o in good], label=f"ZeRO {stage}", s=36)
    over = [o for o in outcomes if o.ran and o.status != OK and (o.measured or o.planned)]
    if over:
        ax.scatter([(o.measured or o.planned or 0) / mib for o in over], [o.metric or 0 for o in over], marker="x",
                   color="gray", label="did not fit / stopped")
    pruned = [o.planned / mib for o in outcomes if not o.ran and o.planned]
    if pruned:
        ax.plot(pruned, [0] * len(pruned), "|", color="black", markersize=14, label="planned, not run")
    if best is not None and best.metric is not None:
        ax.scatter([(best.measured or best.planned or 0) / mib], [best.metric], marker="*", s=300, color="gold",
                   edgecolors="black", zorder=5, label=f"best: {best.candidate.name}")
    shown = [(o.measured or o.planned or 0) / mib for o in outcomes if o.measured or o.planned]
    if budget and budget / mib <= 1.5 * max(shown, default=0):
        ax.axvline(budget / mib, linestyle="--", color="red", label=f"budget {binary_bytes(budget)}")
    elif budget:
        ax.plot([], [], " ", label=f"budget {binary_bytes(budget)} (off the chart)")
    ax.set_xlabel("peak memory per rank (MiB; measured, else planned)")
    ax.set_ylabel({"throughput": "samples/s", "latency": "ms per step"}.get(metric, "FLOPS per GPU"))
    ax.set_title(f"shardwise autotune: {metric} against memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _best_of(outcomes: Sequence[Outcome], metric: str) -> Outcome | None:
    if not outcomes:
        return None
    key = (lambda o: -o.metric) if metric == "latency" else (lambda o: o.metric)
    return max(outcomes, key=key)


def _bytes(n: int | None) -> str:
    return binary_bytes(n) if n else ""


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"
