"""Sequence-length curriculum learning on the README's demo: loss against tokens trained on, with and without.

The demo (examples/demo/train.py: the byte-level GPT on the bundled King James text, 2 processes, its
ds_config.json, `--seq_len` 128) is run twice at world 2:
* baseline: `--steps` steps of full-length windows;
* curriculum: the legacy `curriculum_learning` section (seqlen, fixed_linear from `--min-seqlen` to the full
  length over the first half of the baseline's steps, difficulty_step 8). The engine cuts each window to the
  scheduled length, so a step trains on fewer tokens; the run gets as many steps as it needs to train on at
  least as many tokens as the baseline (tokens = train_batch_size x scheduled length, summed over steps).
Both use the demo's WarmupCosineLR over their own step count. The CSV monitor writes rank 0's mean training
loss every 10 steps; the x axis of the curves is the tokens trained on up to that step (not the samples: the
curriculum trains on fewer tokens per sample early). The demo's validation loss (full-length windows) at the
end is the comparison that counts.

    .venv/bin/python benchmarks/curriculum.py            # the real run (several minutes on 2 cores)
    .venv/bin/python benchmarks/curriculum.py --quick    # smoke: 20 steps of 32-byte windows

Writes benchmarks/results/curriculum.json (`--quick`: curriculum_quick.json) and
curriculum_loss_vs_tokens.png (`--quick`: curriculum_quick_loss_vs_tokens.png).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import REPO_ROOT, RESULTS, environment, free_port, log, pyplot, save_figure, write_report
from _onebit_curves import DEMO, LOSS_CSV, VALIDATION, _env, _first_error

sys.path.insert(0, str(REPO_ROOT / "src"))
from shardwise.config.data_efficiency import LegacyCurriculumConfig  # noqa: E402
from shardwise.data_efficiency import DifficultySchedule  # noqa: E402

WORLD = 2


def curriculum_section(min_seqlen: int, seq_len: int, ramp_steps: int) -> dict[str, Any]:
    return {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": min_seqlen, "max_difficulty": seq_len,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": max(ramp_steps, 1), "difficulty_step": 8}}


def tokens_per_step(section: dict[str, Any] | None, seq_len: int, batch: int, steps: int) -> list[int]:
    """Tokens trained on at each step 1..steps, all ranks together."""
    if section is None:
        return [batch * seq_len] * steps
    schedule = DifficultySchedule(LegacyCurriculumConfig(**section))
    return [batch * min(int(schedule.difficulty(k)), seq_len) for k in range(1, steps + 1)]


def steps_for_tokens(section: dict[str, Any], seq_len: int, batch: int, tokens: int) -> int:
    steps, seen = 0, 0
    while seen < tokens:
        steps += 1
        seen += tokens_per_step(section, seq_len, batch, steps)[-1]
    return steps


def run(name: str, section: dict[str, Any] | None, steps: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    config = json.loads((DEMO / "ds_config.json").read_text())
    config["scheduler"]["params"]["total_num_steps"] = steps
    config["scheduler"]["params"]["warmup_num_steps"] = max(1, steps // 10)
    config["steps_per_print"] = 10
    config["csv_monitor"] = {"enabled": True, "output_path": str(root / "runs"), "job_name": name}
    if section is not None:
        config["curriculum_learning"] = section
    path = root / f"{name}.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "shardwise.cli", "--num_gpus", str(WORLD), "--master_port", str(free_port()),
           str(DEMO / "train.py"), "--config", str(path), "--steps", str(steps), "--seq_len", str(args.seq_len),
           "--eval_interval", str(max(steps, 1)), "--save_dir", str(root / "ckpt" / name), "--sample_bytes", "0"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=args.timeout,
                          check=False)
    output, wall = done.stdout + done.stderr, round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        return {"error": _first_error(output) or f"exit code {done.returncode}", "output_tail": output[-1500:]}
    batch = config["train_micro_batch_size_per_gpu"] * config.get("gradient_accumulation_steps", 1) * WORLD
    cumulative, total = [], 0
    for t in tokens_per_step(section, args.seq_len, batch, steps):
        total += t
        cumulative.append(total)
    with (root / "runs" / name / LOSS_CSV).open(newline="") as f:
        rows = list(csv.reader(f))[1:]
    curve = [(cumulative[int(float(s)) // batch - 1], round(float(v), 5)) for s, v in rows]
    validation = {int(s): float(v) for s, v in VALIDATION.findall(output)}
    return {"steps": steps, "wall_s": wall, "tokens_trained": total, "curriculum_learning": section,
            "final_validation_loss": validation[max(validation)] if validation else None,
            "train_loss_vs_tokens": curve}


def plot(runs: dict[str, dict[str, Any]], png: Path, seq_len: int) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, row in runs.items():
        if "error" not in row:
            xs, ys = zip(*row["train_loss_vs_tokens"])
            ax.plot(xs, ys, label=f"{name} (validation {row['final_validation_loss']:.3f})")
    ax.set_xlabel("tokens trained on (all ranks)")
    ax.set_ylabel("training loss (rank 0, mean of 10 steps)")
    ax.set_title(f"demo GPT, world {WORLD}, {seq_len}-byte windows: seqlen curriculum vs none")
    ax.legend()
    return str(save_figure(plt, fig, png).relative_to(REPO_ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="baseline steps")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--min-seqlen", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 steps of 32-byte windows")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seq_len, args.min_seqlen = 20, 32, 8
    suffix = "_quick" if args.quick else ""
    section = curriculum_section(args.min_seqlen, args.seq_len, args.steps // 2)
    batch = json.loads((DEMO / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"] * WORLD
    curriculum_steps = steps_for_tokens(section, args.seq_len, batch, args.steps * batch * args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"baseline": run("baseline", None, args.steps, args, Path(tmp)),
                "curriculum": run("curriculum", section, curriculum_steps, args, Path(tmp))}
    for name, row in runs.items():
        log(f"[{name}] {row.get('error') or row['final_validation_loss']} ({row.get('wall_s')} s)")
    report = {"benchmark": "curriculum", "environment": environment(), "seq_len": args.seq_len, "runs": runs,
              "plot": plot(runs, RESULTS / f"curriculum{suffix}_loss_vs_tokens.png", args.seq_len)}
    write_report(report, RESULTS / f"curriculum{suffix}.json")


if __name__ == "__main__":
    main()
