"""Training step time with the optimizer offloaded to host memory, against DeepSpeed 0.19.

World size 2 on CPU (gloo, one intra-op thread per rank), the demo GPT preset `bench33m` (33.4M
parameters at sequence length 128), micro-batch 8, AdamW, no clipping: the setup of
`zero_stages.py` with `"offload_optimizer": {"device": "cpu"}` added to `zero_optimization` for
both libraries (same `sub_group_size`, its default 1e9 in both: one sub-group). shardwise steps
the host masters with torch's fused AdamW (`shardwise.optim.adam.CPUAdam`'s kernel); DeepSpeed with its
DeepSpeedCPUAdam op (built on first use). On a CPU-only machine "offload" moves nothing across a
bus: what this measures is each library's bookkeeping around the offloaded step (gradient copies
to the fp32 host buffers, the CPU optimizer, copying the updated values back into the parameters).

Every configuration runs in its own fresh pair of processes, rounds alternate the order; per step
the slower rank's wall time and CPU time. Model-state bytes per rank (shardwise): measured against
the formula, with the host/device split.

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python benchmarks/offload_step.py
    ... --presets demo          (when time is short)

Prints the JSON and writes benchmarks/results/offload_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (
    ADAMW,
    RESULTS,
    LoadSampler,
    environment,
    has_deepspeed,
    log,
    pool_steps,
    ratio,
    verdict,
    write_report,
)
from zero_stages import PERSISTENCE, WORLD, run_config

OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": False}, "sub_group_size": 1_000_000_000}
CONFIGS = ("shardwise-2", "deepspeed-2", "shardwise-3", "deepspeed-3")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="bench33m")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps after --warmup")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(RESULTS / "offload_step.json"))
    args = parser.parse_args(argv)

    load = LoadSampler()
    with_ds = has_deepspeed()
    report: dict[str, Any] = {
        "benchmark": "offload_step",
        "setup": {"world_size": WORLD, "device": "cpu", "backend": "gloo", "seq_len": args.seq_len,
                  "micro_batch": args.micro_batch, "threads_per_rank": args.threads, "rounds": args.rounds,
                  "warmup_steps": args.warmup, "timed_steps": args.steps, "zero_optimization_extra": OFFLOAD,
                  "optimizer": {"type": "AdamW", **ADAMW}, "gradient_clipping": 0.0,
                  "stage3_param_persistence_threshold": PERSISTENCE, **environment()},
        "presets": {},
    }
    for preset_name in args.presets.split(","):
        kinds = [k for k in args.configs.split(",") if with_ds or not k.startswith("deepspeed")]
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for round_index in range(args.rounds):
            for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                started = time.perf_counter()
                runs[kind].append(run_config(kind, args, preset_name, OFFLOAD))
                last = runs[kind][-1]
                shown = last.get("error") or statistics.median(last["step_times_s"])
                log(f"[{preset_name} round {round_index}] {kind} + offload: {shown} ({time.perf_counter() - started:.0f} s)")
        rows: dict[str, Any] = {f"{k}+offload": pool_steps(v, ("threads", "parameters", "optimizer", "model_state_per_rank"))
                                for k, v in runs.items()}
        ratios: dict[str, Any] = {}
        for s in (2, 3):
            sw, ds = rows.get(f"shardwise-{s}+offload"), rows.get(f"deepspeed-{s}+offload")
            for name, key in (("median", "step_time_s_median"), ("fastest", "step_time_s_min"), ("cpu", "cpu_time_s_median")):
                ratios[f"shardwise-{s}/deepspeed-{s} (offload) {name}"] = verdict(ratio(sw, ds, key), 0.9)
            ratios[f"shardwise-{s}/deepspeed-{s} (offload) peak RSS"] = ratio(sw, ds, "peak_rss_mib_per_rank")
        rows["ratios"] = ratios
        report["presets"][preset_name] = rows
    report["setup"]["load_average"] = load.summary()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
