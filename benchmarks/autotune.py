"""`shardwise autotune` against an exhaustive search of the same space, on the bench GPT at world 2 (CPU, gloo):
how far the planner-guided search's best is from the best of all, and how much search time it saves.

Both searches run the demo training script (examples/demo/train.py) through `shardwise autotune` with one
config: global batch 32 (16 per rank), micro-batches 1-16, ZeRO stages 0-3, optimizer and parameter offload
none/cpu (45 candidates), a memory budget per rank (`--budget-mib`) that every candidate must fit. The
exhaustive search is `tuner_type: gridsearch` (every candidate runs; one over the budget stops at step 2, as
an out-of-memory error would); the guided one is the default `model_based`. Each winner is then run again,
the two alternating (`--rounds` pairs), so the comparison of the two winners is not one noisy experiment
each: the paired medians and their ratio are the figure.

    PYTHONPATH=src .venv/bin/python benchmarks/autotune.py                    # the lead's run (~40 min here)
    PYTHONPATH=src .venv/bin/python benchmarks/autotune.py --preset demo --seq-len 64 --rounds 1 \\
        --out /tmp/autotune.json                                             # smoke (~5 min)

Prints the JSON and writes benchmarks/results/autotune.json (and the two searches' plots next to it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ADAMW, REPO_ROOT, RESULTS, environment, log, write_report

WORLD = 2


def tune_config(batch: int, budget: int, tuner: str) -> dict[str, Any]:
    return {"train_batch_size": batch, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": ADAMW},
            "autotuning": {"enabled": True, "tuner_type": tuner, "memory_per_rank": budget, "tuner_num_trials": 1000}}


def script_args(preset: str, seq_len: int, work: Path, config: Path) -> list[str]:
    return [str(REPO_ROOT / "examples/demo/train.py"), "--deepspeed_config", str(config), "--preset", preset,
            "--seq_len", str(seq_len), "--steps", "1000", "--save_dir", str(work / "ckpt")]


def search(name: str, tuner: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    where = work / name
    where.mkdir()
    config = where / "ds_tune.json"
    config.write_text(json.dumps(tune_config(args.batch, args.budget_mib * 2**20, tuner)))
    command = [sys.executable, "-m", "shardwise.cli", "autotune", "--num_gpus", str(WORLD),
               *script_args(args.preset, args.seq_len, work, config)]
    log(name, "searching")
    done = subprocess.run(command, cwd=where, capture_output=True, text=True)
    (where / "autotune.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: autotune failed ({done.returncode}):\n{done.stderr[-3000:]}")
    results = json.loads((where / "autotuning_results" / "results.json").read_text())
    shutil.copy(where / "autotuning_results" / "throughput_vs_memory.png", Path(args.out).with_name(
        f"autotune_{name}.png"))
    ran = [e for e in results["experiments"] if e["status"] not in ("pruned", "dominated", "not run")]
    fitted = [e for e in ran if e["status"] == "ok"]
    log(name, f"{len(ran)} experiments in {results['seconds']:.0f} s; best {results['best']}")
    return {"seconds": round(results["seconds"], 1), "experiments_run": len(ran),
            "experiment_seconds": round(sum(e["seconds"] for e in ran), 1),
            "not_run": len(results["experiments"]) - len(ran),
            "statuses": {s: sum(e["status"] == s for e in results["experiments"])
                         for s in sorted({e["status"] for e in results["experiments"]})},
            "best": results["best"],
            "best_throughput": max((e["metric"] for e in fitted), default=None),
            "ranking": sorted(((e["name"], round(e["metric"], 3)) for e in fitted), key=lambda x: -x[1]),
            "planned_over_measured": [round(e["planned"] / e["measured"], 3) for e in ran
                                      if e["planned"] and e["measured"]],
            "experiments": {e["name"]: {"status": e["status"], "planned_mib": _mib(e["planned"]),
                                        "measured_mib": _mib(e["measured"]), "throughput": e["metric"],
                                        "seconds": round(e["seconds"], 1)} for e in results["experiments"]},
            "config": str(where / "autotuning_results" / results["best"] / "ds_config.json")}


def _mib(n: int | None) -> float | None:
    return round(n / 2**20, 1) if n else None


def pruning_agreement(guided: dict[str, Any], exhaustive: dict[str, Any], budget_mib: int) -> dict[str, Any]:
    """The guided search's plan of every candidate against the peak the exhaustive search measured for it:
    candidates the plan put over the budget that fit (lost), and under it that did not (run in vain)."""
    lost, in_vain, pairs = [], [], []
    for name, found in guided["experiments"].items():
        measured = exhaustive["experiments"].get(name, {}).get("measured_mib")
        planned = found["planned_mib"]
        if planned is None or measured is None:
            continue
        pairs.append(planned / measured)
        if planned > budget_mib >= measured:
            lost.append(name)
        if planned <= budget_mib < measured:
            in_vain.append(name)
    return {"candidates": len(pairs), "planned_over_measured_min": round(min(pairs), 3),
            "planned_over_measured_max": round(max(pairs), 3), "pruned_but_fit": lost, "planned_to_fit_but_did_not": in_vain}


def rerun(config_path: str, args: argparse.Namespace, work: Path, round_: int, name: str) -> float:
    """The winner's config once more (its own experiment settings, a fresh metrics file): samples/s."""
    config = json.loads(Path(config_path).read_text())
    metrics = work / f"rerun_{name}_{round_}.json"
    config["autotuning"] |= {"metric_path": str(metrics), "stop_below": None, "memory_per_rank": None}
    path = work / f"rerun_{name}_{round_}_config.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "shardwise.cli", "--num_gpus", str(WORLD),
               *script_args(args.preset, args.seq_len, work, path)]
    subprocess.run(command, cwd=work, capture_output=True, text=True, check=True)
    return float(json.loads(metrics.read_text())["throughput"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bench33m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="global batch (held by every candidate)")
    parser.add_argument("--budget-mib", type=int, default=1000, help="memory per rank every candidate must fit")
    parser.add_argument("--rounds", type=int, default=3, help="paired reruns of the two winners")
    parser.add_argument("--out", default=str(RESULTS / "autotune.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        guided = search("guided", "model_based", args, work)
        exhaustive = search("exhaustive", "gridsearch", args, work)
        paired: dict[str, list[float]] = {"guided": [], "exhaustive": []}
        for round_ in range(args.rounds):
            order = ("guided", "exhaustive") if round_ % 2 == 0 else ("exhaustive", "guided")
            for name in order:
                found = guided if name == "guided" else exhaustive
                paired[name].append(rerun(found["config"], args, work, round_, name))
            log("rerun", round_, {k: round(v[-1], 2) for k, v in paired.items()})
    medians = {k: statistics.median(v) for k, v in paired.items()}
    report = {"benchmark": "autotune", "preset": args.preset, "seq_len": args.seq_len, "world": WORLD,
              "global_batch": args.batch, "budget_mib": args.budget_mib,
              "guided": guided, "exhaustive": exhaustive,
              "winners_rerun_throughput": {k: [round(x, 3) for x in v] for k, v in paired.items()},
              "summary": {
                  "guided_best": guided["best"], "exhaustive_best": exhaustive["best"],
                  "guided_over_exhaustive_throughput_rerun_median": round(medians["guided"] / medians["exhaustive"], 3),
                  "guided_over_exhaustive_throughput_in_search": round(
                      guided["best_throughput"] / exhaustive["best_throughput"], 3),
                  "guided_over_exhaustive_search_time": round(guided["seconds"] / exhaustive["seconds"], 3),
                  "experiments_run": {"guided": guided["experiments_run"], "exhaustive": exhaustive["experiments_run"]},
                  "plan_against_exhaustive_measurements": pruning_agreement(guided, exhaustive, args.budget_mib)},
              "environment": environment()}
    for found in (guided, exhaustive):
        found.pop("config")
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
