"""What `onebit.py` computes from its runs: one row per (optimizer, world, link) from the ranks' results,
the ratios against the baseline optimizer of the same run, the printed table and the PNG.

Figures per row are over the measured steps only (after the warm-up, whose steps are excluded): the step
time is the slowest rank's; "tx" is what a host's `eth0` sent (one rank per host, so a rank's bytes on the
wire), read over the whole measured window with a barrier at both ends (exact), and also per step without
one (`per_step.tx_mb`: a shaped link may still hold a step's last bytes, which then count in the next step);
"issued" is what the engine's comm stats counted on rank 0 (each collective's payload, as `comms_logger`
shows it); "expected" is what gloo's algorithms send for those collectives ([Note: bytes on the wire] in
_slow_links_report.py).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from _harness import print_columns, pyplot, save_figure, verdict
from _netns_ranks import print_shaping
from _slow_links_report import expected_tx_bytes

MB = 1e6
TARGET_LESS = 5.0
"""The issue's target: at least 5x fewer bytes on the wire per step than the baseline, after the warm-up."""


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    """Median, quartiles and extremes of `values`."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {k: round(v, digits) for k, v in
            (("median", statistics.median(values)), ("p25", q[0]), ("p75", q[2]), ("min", min(values)),
             ("max", max(values)))}


def _slowest(ranks: list[dict[str, Any]], key: str) -> list[float]:
    return [max(ts) for ts in zip(*(r["per_step"][key] for r in ranks))]


def _phase(ranks: list[dict[str, Any]], steps: slice) -> dict[str, Any]:
    """Medians over the steps of one phase: slowest rank's time, rank 0's issued bytes, mean tx over hosts."""
    times = _slowest(ranks, "time_s")[steps]
    issued = ranks[0]["per_step"]["comm_bytes"][steps]
    tx = [statistics.fmean(ts) for ts in zip(*(r["per_step"]["tx_bytes"] for r in ranks))][steps]
    if not times:
        return {}
    return {"step_time_s_median": round(statistics.median(times), 4),
            "issued_mb_per_step_median": round(statistics.median(issued) / MB, 4),
            "tx_mb_per_step_median": round(statistics.median(tx) / MB, 4)}


def summarize(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One run's row (one rank per host); the first step (the engine's start: parameters broadcast, buckets
    built) is left out of the warm-up phase's medians."""
    steps = len(ranks[0]["step_times_s"])
    times = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))]
    tx = [r["interface"]["tx_bytes"] / steps for r in ranks]
    comm = ranks[0]["comm_per_step"]
    issued = sum(op["bytes"] for ops in comm.values() for op in ops.values())
    expected = expected_tx_bytes(comm, ranks[0]["group_sizes"], list(range(len(ranks))))
    measured = slice(warmup, None)
    losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in ranks))]
    return {
        "world": len(ranks), "warmup_steps": warmup, "measured_steps": steps,
        "step_time_s": spread(times), "step_times_s": [round(t, 4) for t in times],
        "cpu_time_s_median": round(statistics.median(max(ts) for ts in zip(*(r["cpu_times_s"] for r in ranks))), 4),
        "tx_mb_per_step": round(statistics.fmean(tx) / MB, 4), "tx_mb_per_step_per_host": [round(t / MB, 4) for t in tx],
        "rx_mb_per_step": round(statistics.fmean(r["interface"]["rx_bytes"] for r in ranks) / steps / MB, 4),
        "issued_mb_per_step_rank0": round(issued / MB, 4), "comm_per_step_rank0": comm,
        "group_sizes": ranks[0]["group_sizes"],
        "expected_tx_mb_per_step_per_host": [round(e / MB, 4) for e in expected],
        "tx_over_expected_per_host": [round(t / e, 4) if e else None for t, e in zip(tx, expected)],
        "per_step": {"time_s": [round(t, 4) for t in _slowest(ranks, "time_s")],
                     "issued_mb_rank0": [round(b / MB, 4) for b in ranks[0]["per_step"]["comm_bytes"]],
                     "tx_mb": [round(statistics.fmean(ts) / MB, 4)
                               for ts in zip(*(r["per_step"]["tx_bytes"] for r in ranks))]},
        "measured_tx_mb_spread": spread([statistics.fmean(ts) / MB for ts in
                                         zip(*(r["per_step"]["tx_bytes"][measured] for r in ranks))]),
        "warmup_phase": _phase(ranks, slice(1, warmup)),
        "losses": [round(x, 5) for x in losses], "final_loss": round(losses[-1], 5),
    }


def add_ratios(by_optimizer: dict[str, dict[str, Any]], baseline_of: dict[str, str]) -> None:
    """Each row with a baseline run in `by_optimizer` (same world and link, same invocation) gets `vs_baseline`."""
    for name, row in by_optimizer.items():
        base = by_optimizer.get(baseline_of.get(name, ""))
        if "error" in row or not base or "error" in base:
            continue
        less = base["tx_mb_per_step"] / row["tx_mb_per_step"] if row["tx_mb_per_step"] else math.inf
        row["vs_baseline"] = {
            "baseline": baseline_of[name],
            "tx_bytes_times_less": round(less, 2),
            "issued_bytes_times_less": round(base["issued_mb_per_step_rank0"] / row["issued_mb_per_step_rank0"], 2)
            if row["issued_mb_per_step_rank0"] else None,
            "step_time_ratio": round(row["step_time_s"]["median"] / base["step_time_s"]["median"], 3),
            "step_time_ratio_of_min": round(row["step_time_s"]["min"] / base["step_time_s"]["min"], 3),
            "final_loss_ratio": round(row["final_loss"] / base["final_loss"], 4),
            "target_tx_times_less": verdict(round(less, 2), TARGET_LESS, at_most=False),
        }


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "refused" if row["error"].startswith("ConfigError") else "error: " + row["error"].splitlines()[0][:40]
    text = f"{row['step_time_s']['median']:.3f} s {row['tx_mb_per_step']:.2f} MB"
    vs = row.get("vs_baseline")
    return text + (f" ({vs['tx_bytes_times_less']:.1f}x less, t {vs['step_time_ratio']:.2f}x)" if vs else "")


def print_table(report: dict[str, Any]) -> None:
    """Per (world, optimizer): per link the median step, MB each host sent per step, and the ratios."""
    links = list(report["setup"]["links"])
    lines = [["world", "optimizer", *[f"{link}: step, tx/host/step" for link in links]]]
    for world, by_opt in report["results"].items():
        for name, by_link in by_opt.items():
            lines.append([world, name, *[_cell(by_link.get(link)) for link in links]])
    print_columns(lines)
    print_shaping(report["setup"]["links"])


def plot(report: dict[str, Any], path: Path) -> Path | str:
    """Per world: median step time and MB sent per host per step (log scale), bars per link, per optimizer."""
    plt = pyplot()
    if plt is None:
        return "no PNG (matplotlib is not installed)"
    worlds, all_links = list(report["results"]), list(report["setup"]["links"])
    fig, axes = plt.subplots(len(worlds), 2, figsize=(12, 3.8 * len(worlds)), squeeze=False)
    for (ax_time, ax_bytes), world in zip(axes, worlds):
        names = list(report["results"][world])
        links = [k for k in all_links if any(k in by_link for by_link in report["results"][world].values())]
        width = 0.8 / max(1, len(links))
        for j, link in enumerate(links):
            color = f"C{all_links.index(link)}"  # a link has one colour in every panel
            rows = [report["results"][world][n].get(link) for n in names]
            xs = [i + (j - (len(links) - 1) / 2) * width for i in range(len(names))]
            ok = [(x, r) for x, r in zip(xs, rows) if r and "error" not in r]
            ax_time.bar([x for x, _ in ok], [r["step_time_s"]["median"] for _, r in ok], width, label=link, color=color,
                        yerr=[[r["step_time_s"]["median"] - r["step_time_s"]["p25"] for _, r in ok],
                              [r["step_time_s"]["p75"] - r["step_time_s"]["median"] for _, r in ok]])
            ax_bytes.bar([x for x, _ in ok], [r["tx_mb_per_step"] for _, r in ok], width, label=link, color=color)
            for ax in (ax_time, ax_bytes):
                for x, r in zip(xs, rows):
                    if r and "error" in r:
                        ax.text(x, 0.02, "refused", rotation=90, ha="center", va="bottom", fontsize=7,
                                transform=ax.get_xaxis_transform())  # y in axes units: the log axis has no 0
        sent = [r["tx_mb_per_step"] for by_link in report["results"][world].values() for r in by_link.values()
                if r.get("tx_mb_per_step")]
        if sent and max(sent) > 5 * min(sent):  # 1-bit bytes next to Adam's read in log scale
            ax_bytes.set_yscale("log")
        for ax, title in ((ax_time, "median step time (s), slowest rank (bars: quartiles)"),
                          (ax_bytes, "MB sent per host per step (eth0) after warm-up")):
            ax.set_xticks(range(len(names)), names, rotation=15)
            ax.set_title(f"world {world}: {title}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize="small")
    return save_figure(plt, fig, path)
