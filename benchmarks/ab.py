"""Interleaved A/B of two shardwise trees on the ZeRO step: is HEAD slower than BASE?

Each revision is checked out (`git worktree`, under --trees) and imported from its own `src`; the model, data and
config are this tree's (benchmarks/_ab_rank.py), so only shardwise differs. Every lane — the compute floor, and
ZeRO stage S of BASE and of HEAD — is its own group of `--world` gloo processes, all started at once and kept
alive; then step i runs lane by lane, one lane at a time, in an order that rotates every step and reverses every
other, so the machine's drift moves every lane alike. Per lane and step the slower rank's wall time counts, and
that rank's CPU time (all threads of its process).

Figures: per lane the median step, and its paired ratio to the floor (median over steps of lane_i / floor_i);
per stage the paired ratio HEAD/BASE, wall and CPU, each with its spread (the 10th-90th percentile of the paired
ratios). A slowdown of HEAD shows as head_over_base > 1.

    .venv/bin/python benchmarks/ab.py f2f17c7 HEAD                     # stages 2 and 3, bench33m
    .venv/bin/python benchmarks/ab.py 950ff4c . --stages 3 --steps 30  # '.': this working tree, uncommitted
    .venv/bin/python benchmarks/ab.py BASE HEAD --history              # and append HEAD's ratios to history.jsonl

Writes benchmarks/results/ab/<base>-<head>.json (--out to change). `--history` appends one line per run to
benchmarks/results/history.jsonl: the head commit, its ratios to the floor, the base's, and the load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (REPO_ROOT, RESULTS, LoadSampler, free_port, log, paired_spread, print_columns, pyplot,
                      save_figure)

RANK_SCRIPT = Path(__file__).resolve().parent / "_ab_rank.py"
HISTORY = RESULTS / "history.jsonl"
HISTORY_PLOT = RESULTS / "history.png"


def resolve(rev: str) -> str:
    """A full commit id, or '.' for the working tree."""
    if rev == ".":
        return rev
    return subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO_ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()


def checkout(commit: str, trees: Path) -> Path:
    """The tree whose `src` the lanes of `commit` import: a detached worktree, made once and reused."""
    if commit == ".":
        return REPO_ROOT
    tree = trees / commit[:12]
    if not (tree / "src" / "shardwise").is_dir():
        trees.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(tree), commit], cwd=REPO_ROOT,
                       check=True, capture_output=True)
    return tree


class Lane:
    """`world` rank processes of one configuration, waiting for `step I`."""

    def __init__(self, name: str, kind: str, src: Path | None, args: argparse.Namespace, logs: Path):
        self.name, self.walls, self.cpus = name, [], []
        port = free_port()
        pythonpath = [str(src)] if src else []
        env_base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(args.world), "LOCAL_WORLD_SIZE": str(args.world),
                    "PYTHONPATH": os.pathsep.join(pythonpath + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        command = [sys.executable, str(RANK_SCRIPT), kind, args.preset, str(args.seq_len), str(args.micro_batch),
                   str(args.warmup + args.steps)]
        self.log = logs / f"{name}.log"
        with self.log.open("w") as err:
            self.ranks = [subprocess.Popen(command, env={**env_base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                           bufsize=1) for r in range(args.world)]

    def _answers(self) -> list[dict[str, Any]]:
        out = []
        for rank in self.ranks:
            line = rank.stdout.readline()
            if not line:
                raise RuntimeError(f"lane {self.name}: a rank exited (code {rank.wait()}); see {self.log}")
            out.append(json.loads(line))
        return out

    def ready(self) -> str | None:
        return self._answers()[0]["shardwise"]

    def step(self, i: int) -> None:
        for rank in self.ranks:
            rank.stdin.write(f"step {i}\n")
        answers = self._answers()
        slowest = max(answers, key=lambda a: a["wall"])
        self.walls.append(slowest["wall"])
        self.cpus.append(slowest["cpu"])

    def close(self) -> None:
        for rank in self.ranks:
            try:
                rank.stdin.write("quit\n")
                rank.stdin.close()
            except OSError:
                pass
        for rank in self.ranks:
            try:
                rank.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rank.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    base, head = resolve(args.base), resolve(args.head)
    trees = {rev: checkout(rev, Path(args.trees)) for rev in (base, head)}
    logs = REPO_ROOT / "runs" / "ab"  # the lanes' stderr (gitignored)
    logs.mkdir(parents=True, exist_ok=True)
    specs = [("floor", "floor", None)] + [(f"{tag}-zero-{s}", f"zero-{s}", trees[rev] / "src")
                                         for s in args.stages for tag, rev in (("base", base), ("head", head))]
    lanes = [Lane(name, kind, src, args, logs) for name, kind, src in specs]
    try:
        sources = {lane.name: lane.ready() for lane in lanes}
        log("ab: lanes ready:", json.dumps(sources))
        load = LoadSampler()
        started = time.perf_counter()
        for i in range(args.warmup + args.steps):
            order = lanes[i % len(lanes):] + lanes[:i % len(lanes)]
            for lane in order if i % 2 == 0 else order[::-1]:
                lane.step(i)
        elapsed = time.perf_counter() - started
        load_summary = load.summary()
    finally:
        for lane in lanes:
            lane.close()
    timed = {lane.name: (lane.walls[args.warmup:], lane.cpus[args.warmup:]) for lane in lanes}
    floor_wall, floor_cpu = timed["floor"]
    per_lane = {name: {"median_step_s": round(statistics.median(w), 4), "median_cpu_s": round(statistics.median(c), 4),
                       "over_floor": paired_spread(w, floor_wall), "cpu_over_floor": paired_spread(c, floor_cpu)}
                for name, (w, c) in timed.items()}
    head_over_base = {f"zero-{s}": {"wall": paired_spread(timed[f"head-zero-{s}"][0], timed[f"base-zero-{s}"][0]),
                                    "cpu": paired_spread(timed[f"head-zero-{s}"][1], timed[f"base-zero-{s}"][1])}
                      for s in args.stages}
    return {"benchmark": "ab", "base": base, "head": head if head != "." else f"{resolve('HEAD')}+worktree",
            "setup": {"preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                      "world_size": args.world, "threads_per_rank": 1, "warmup": args.warmup, "steps": args.steps,
                      "backend": "gloo", "sources": sources},
            "lanes": per_lane, "head_over_base": head_over_base, "load": load_summary,
            "elapsed_s": round(elapsed, 1), "date": datetime.datetime.now().isoformat(timespec="seconds")}


def append_history(report: dict[str, Any]) -> None:
    lanes = report["lanes"]
    line = {"commit": report["head"], "base": report["base"], "date": report["date"], "setup": report["setup"]["preset"],
            "over_floor": {name: lanes[name]["over_floor"]["median"] for name in lanes if name != "floor"},
            "head_over_base": {s: v["wall"]["median"] for s, v in report["head_over_base"].items()},
            "load": report["load"]}
    with HISTORY.open("a") as f:
        f.write(json.dumps(line) + "\n")


def plot_history() -> Path | None:
    """history.png: each lane's paired ratio to the floor, run by run (x: the head commit, in file order)."""
    plt = pyplot()
    if plt is None or not HISTORY.exists():
        return None
    runs = [json.loads(line) for line in HISTORY.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(max(6, len(runs) * 0.6), 4))
    for lane in sorted({name for run in runs for name in run["over_floor"]}):
        points = [(i, run["over_floor"][lane]) for i, run in enumerate(runs) if lane in run["over_floor"]]
        ax.plot(*zip(*points), marker="o", label=lane)
    ax.axhline(1.05, color="grey", linestyle=":", label="ZeRO-3 target")
    ax.axhline(1.03, color="grey", linestyle="--", label="ZeRO-0..2 target")
    ax.set_xticks(range(len(runs)), [run["commit"][:7] for run in runs], rotation=45, ha="right")
    ax.set_ylabel("step time / compute floor (paired median)")
    ax.set_title(f"ZeRO step over the floor, {runs[-1]['setup']}, world 2, gloo")
    ax.legend(fontsize="small")
    return save_figure(plt, fig, HISTORY_PLOT)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", nargs="?", help="a commit (or '.' for the working tree)")
    parser.add_argument("head", nargs="?", help="a commit (or '.' for the working tree)")
    parser.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3])
    parser.add_argument("--preset", default="bench33m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trees", default="/tmp/shardwise-ab", help="where the revisions are checked out")
    parser.add_argument("--out", default=None)
    parser.add_argument("--history", action="store_true", help="append HEAD's ratios to " + str(HISTORY))
    parser.add_argument("--plot", action="store_true", help=f"only redraw {HISTORY_PLOT} from {HISTORY}")
    args = parser.parse_args(argv)
    if args.plot:
        print(plot_history())
        return {}
    if not (args.base and args.head):
        parser.error("give BASE and HEAD (commits, or '.' for the working tree)")
    report = run(args)
    out = Path(args.out) if args.out else RESULTS / "ab" / f"{report['base'][:8]}-{report['head'][:8]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    rows = [["lane", "median step s", "over floor (p10-p90)", "cpu over floor"]]
    for name, lane in report["lanes"].items():
        o, c = lane["over_floor"], lane["cpu_over_floor"]
        rows.append([name, lane["median_step_s"], f"{o['median']} ({o['p10']}-{o['p90']})", c["median"]])
    print_columns(rows)
    for stage, r in report["head_over_base"].items():
        w = r["wall"]
        print(f"{stage}: head/base wall {w['median']} ({w['p10']}-{w['p90']}), cpu {r['cpu']['median']}")
    print(f"load {report['load']}; wrote {out}")
    if args.history:
        append_history(report)
        plot_history()
    return report


if __name__ == "__main__":
    main()
