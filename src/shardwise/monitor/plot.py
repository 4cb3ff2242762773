"""`shardwise plot RUN_DIR`: the CSV monitor's curves (loss, lr, throughput, memory, step times) as one PNG.

Reads every `*.csv` the CSV monitor wrote under RUN_DIR (its `<output_path>/<job_name>` folder, or any
folder above it), one panel per kind of figure, and writes RUN_DIR/curves.png (or `--output`).
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass
from pathlib import Path

ENGINE_FILE_PREFIX = "Train_Samples_"


@dataclass(frozen=True)
class Series:
    name: str
    """The CSV header's value column (the last part of the event name)."""
    x_label: str
    steps: list[float]
    values: list[float]


@dataclass(frozen=True)
class Panel:
    title: str
    series: list[Series]


def read_series(path: Path) -> Series | None:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or len(rows[0]) != 2:
        return None
    steps, values = [], []
    for step, value in rows[1:]:
        steps.append(float(step))
        values.append(float(value))
    x_label = "samples" if path.name.startswith(ENGINE_FILE_PREFIX) else "step"
    return Series(rows[0][1], x_label, steps, values)


def _panel_of(name: str) -> str:
    if "loss" in name and name != "loss_scale":
        return "loss"
    if name == "lr":
        return "learning rate"
    if name.startswith("elapsed_time_ms_"):
        return "time per step (ms)"
    if name.startswith("memory_") or name == "peak_memory_mb":
        return "memory (MB)"
    return {"samples_per_sec": "samples / s", "tokens_per_sec": "tokens / s", "tflops_per_rank": "TFLOPS per rank",
            "grad_norm": "gradient norm", "loss_scale": "loss scale"}.get(name, name)


_ORDER = ["loss", "learning rate", "samples / s", "tokens / s", "TFLOPS per rank", "memory (MB)",
          "time per step (ms)", "gradient norm", "loss scale"]


def panels(run_dir: Path) -> list[Panel]:
    grouped: dict[str, list[Series]] = {}
    for path in sorted(run_dir.rglob("*.csv")):
        series = read_series(path)
        if series is not None:
            grouped.setdefault(_panel_of(series.name), []).append(series)
    rank = {title: i for i, title in enumerate(_ORDER)}
    return [Panel(t, grouped[t]) for t in sorted(grouped, key=lambda t: (rank.get(t, len(_ORDER)), t))]


def render(run_dir: Path, output: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("shardwise plot: needs matplotlib; pip install matplotlib (or shardwise[monitor]).") from None

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    found = panels(run_dir)
    if not found:
        raise FileNotFoundError(f"RUN_DIR {str(run_dir)!r}: no CSV monitor files (*.csv) under it. "
                                'Train with "csv_monitor": {"enabled": true, "output_path": ...} and pass its folder.')
    cols = min(3, len(found))
    rows = math.ceil(len(found) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, found):
        for s in panel.series:
            ax.plot(s.steps, s.values, marker="." if len(s.steps) < 30 else None, label=_legend(s.name))
        if _spans_decades(panel):
            ax.set_yscale("log")
        ax.set_title(panel.title)
        ax.set_xlabel(panel.series[0].x_label)
        ax.grid(alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(found):]:
        ax.set_visible(False)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def _legend(name: str) -> str:
    if name.startswith("elapsed_time_ms_"):
        return name[len("elapsed_time_ms_"):]
    if name.startswith("memory_") and name.endswith("_mb"):
        return name[len("memory_"):-len("_mb")]
    return name.removesuffix("_mb")


def _spans_decades(panel: Panel) -> bool:
    """Curves of very different sizes (memory: RSS next to kilobytes of parameters) read better in log scale."""
    peaks = [max(s.values) for s in panel.series if s.values and min(s.values) > 0]
    return len(peaks) > 1 and max(peaks) > 30 * min(peaks)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardwise plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the CSV monitor's folder (output_path/job_name)")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        parser.error(f"RUN_DIR {args.run_dir!r}: not a directory")
    try:
        out = render(run_dir, Path(args.output) if args.output else run_dir / "curves.png")
    except FileNotFoundError as e:
        parser.error(str(e))
    print(f"wrote {out}")
    return 0
