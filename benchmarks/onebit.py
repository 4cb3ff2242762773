"""Communication-compressed optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) against Adam and LAMB, across slow links.

Two parts:

* Links: the bench GPT (examples/demo `GPT`, d_model 384, 6 layers, 10.8M parameters, micro-batch 2 x 128
  tokens per rank; slow_links.py's "full" model) at ZeRO stage 0, one rank per namespace host (`_netns.py`:
  hosts on one bridge, every link shaped with tc), world 2 across 2 hosts and world 4 across 4. Per
  (optimizer, world, link): `--freeze` + 1 warm-up steps (the 1-bit optimizers' exact phase: their
  `freeze_step` / `var_freeze_step` is `--freeze`), excluded; then `--steps` measured steps: the slowest
  rank's time, the bytes each host's eth0 sent, the bytes the engine's comm stats counted, the losses. A
  1-bit optimizer is compared with its baseline (Adam, or LAMB for 1-bit LAMB) of the same invocation,
  same world and link. An optimizer the library refuses is a row with its error, not a crash.
* Loss curves: the README's demo (2 processes, plain gloo on localhost) for `--curve-steps` steps per
  optimizer, the CSV monitor on, one PNG by `shardwise plot` (`_onebit_curves.py`).

    sudo .venv/bin/python benchmarks/onebit.py                 # everything (~30-40 min on 2 cores)
    sudo .venv/bin/python benchmarks/onebit.py --quick         # smoke: tiny GPT, 2 + 3 steps, 20 demo steps
    sudo .venv/bin/python benchmarks/onebit.py --links 1gbit --world2 Adam,OneBitAdam --no-curves

Writes benchmarks/results/onebit.json (`--quick`: onebit_quick.json), onebit.png (bytes and step time) and
onebit_loss.png (the demo's loss curves), and prints a table. See benchmarks/README.md
("Communication-compressed optimizers").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import REPO_ROOT, RESULTS, LoadSampler, environment, log, write_report
from _netns import INTERFACE, switched_hosts
from _netns_ranks import require_hosts, run_ranks
from _onebit_curves import DEMO, run_curves
from _onebit_report import add_ratios, plot, print_table, summarize
from _slow_links_models import MODELS, QUICK_MODELS, parameter_counts

OPTIMIZERS = ("Adam", "OneBitAdam", "ZeroOneAdam", "ZeroOneAdam-sync4", "Lamb", "OneBitLamb")
BASELINE_OF = {"OneBitAdam": "Adam", "ZeroOneAdam": "Adam", "ZeroOneAdam-sync4": "Adam", "OneBitLamb": "Lamb"}
# name -> (tc rate, one-way delay in ms): the delay needs netem, which this machine's kernel lacks (_netns.py)
LINKS: dict[str, tuple[str | None, float]] = {"unshaped": (None, 0.0), "1gbit": ("1gbit", 0.2),
                                               "100mbit": ("100mbit", 1.0)}
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}
# The links' runs: Adam's usual settings without weight decay (then "Adam" is plain Adam in every library)
BENCH_ADAM = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
BENCH_LAMB = {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
# LAMB's step is about lr x the layer's weight norm: the demo's 3e-3 (AdamW's) is far too slow for it; of 3e-3,
# 1e-2 and 2e-2 over 60 demo steps, 2e-2 came closest to AdamW (validation 2.37 against 2.34)
DEMO_LAMB_LR = 2e-2
ZERO_ONE_KEYS = {"var_update_scaler": 16, "local_step_scaler": 32678, "local_step_clipper": 16}  # DeepSpeed's
# DeepSpeed's local-step schedule doubles the interval between syncs every 32678 steps: a short run syncs every
# step. "-sync4" doubles it after every local step, up to 4, to show what the skipped syncs save.
SYNC4_KEYS = {**ZERO_ONE_KEYS, "local_step_scaler": 1, "local_step_clipper": 4}


def optimizer_configs(adam: dict[str, Any], lamb: dict[str, Any], freeze: int) -> dict[str, dict[str, Any]]:
    """Each optimizer's `optimizer` config section: the baselines' params, plus the 1-bit keys."""
    return {"Adam": {"type": "Adam", "params": adam},
            "OneBitAdam": {"type": "OneBitAdam", "params": {**adam, "freeze_step": freeze}},
            "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {**adam, "var_freeze_step": freeze, **ZERO_ONE_KEYS}},
            "ZeroOneAdam-sync4": {"type": "ZeroOneAdam", "params": {**adam, "var_freeze_step": freeze, **SYNC4_KEYS}},
            "Lamb": {"type": "Lamb", "params": lamb},
            "OneBitLamb": {"type": "OneBitLamb", "params": {**lamb, "freeze_step": freeze}}}


def _spec(args: argparse.Namespace, optimizer: dict[str, Any]) -> dict[str, Any]:
    return {"model": (QUICK_MODELS if args.quick else MODELS)["full"], "seed": args.seed,
            "warmup": args.freeze + 1, "steps": args.steps, "zero": {}, "interface": INTERFACE,
            "config": {"optimizer": optimizer, "zero_optimization": {"stage": 0}, **PRECISION[args.precision]}}


def _runs_on(link: str, args: argparse.Namespace) -> list[tuple[int, str]]:
    """(world, optimizer) of every run on `link`, world 2 first."""
    runs = [(2, o) for o in args.world2]
    return runs + ([(4, o) for o in args.world4] if link in args.world4_links else [])


def run_links(args: argparse.Namespace) -> dict[str, Any]:
    """Every (link, world, optimizer): hosts are made once per link (4 when a world-4 run needs them; a world-2
    run uses hosts 0 and 1), a run gets fresh processes and master port."""
    configs = optimizer_configs(BENCH_ADAM, BENCH_LAMB, args.freeze)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    shaping, port = {}, 29800
    with tempfile.TemporaryDirectory(prefix="onebit_") as root:
        for link in args.links:
            runs = _runs_on(link, args)
            with switched_hosts(max(w for w, _ in runs), *LINKS[link]) as net:
                for world, name in runs:
                    spec, port = _spec(args, configs[name]), port + 1
                    tmp = Path(root) / f"{link}-{world}-{name}"
                    tmp.mkdir()
                    started = time.perf_counter()
                    ranks = run_ranks(net, spec, world, 1, tmp, port, args.timeout)
                    row = ranks if isinstance(ranks, dict) else summarize(ranks, spec["warmup"])
                    row.update(optimizer=configs[name], wall_s=round(time.perf_counter() - started, 1))
                    results.setdefault(str(world), {}).setdefault(name, {})[link] = row
                    outcome = row["error"][:100] if "error" in row else f"{row['step_time_s']['median']} s/step"
                    log(f"[{link} world {world} {name}] {outcome} (run: {row['wall_s']} s)")
                shaping[link] = {**net.shaping.__dict__, "hosts": len(net.hosts),
                                 "qdisc_counters_per_host": net.qdisc_stats()}
    for by_opt in results.values():
        for link in args.links:
            add_ratios({n: rows[link] for n, rows in by_opt.items() if link in rows}, BASELINE_OF)
    return {"results": results, "links": shaping}


def key_figures(results: dict[str, Any], curves: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's figures in one place: per 1-bit optimizer and link, x less on the wire and the step-time ratio;
    the demo's final losses over the baseline's."""
    out: dict[str, Any] = {}
    for world, by_opt in results.items():
        for name, by_link in by_opt.items():
            for link, row in by_link.items():
                if "vs_baseline" in row:
                    vs = row["vs_baseline"]
                    out.setdefault(f"world{world}", {}).setdefault(name, {})[link] = {
                        "tx_times_less": vs["tx_bytes_times_less"], "issued_times_less": vs["issued_bytes_times_less"],
                        "step_time_ratio": vs["step_time_ratio"], "met_5x": vs["target_tx_times_less"]["met"]}
    for name, row in ((curves or {}).get("runs") or {}).items():
        if "vs_baseline" in row:
            out.setdefault("demo_final_loss_over_baseline", {})[name] = row["vs_baseline"]
    return out


def _tree_state() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()

    changed = [line for line in git("status", "--porcelain").splitlines() if "benchmarks/results/" not in line]
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_outside_results": changed}


def _names(value: str, allowed: tuple[str, ...] | dict[str, Any], flag: str) -> list[str]:
    names = [x for x in value.split(",") if x]
    unknown = [x for x in names if x not in allowed]
    if unknown:
        raise SystemExit(f"--{flag}: each of {','.join(allowed)}; got {','.join(unknown)}.")
    return names


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--links", default=",".join(LINKS), help="of " + ",".join(LINKS))
    add("--world2", default=",".join(OPTIMIZERS), help="optimizers at world 2, of " + ",".join(OPTIMIZERS))
    add("--world4", default="Adam,OneBitAdam,ZeroOneAdam", help="optimizers at world 4 (4 hosts); empty: none")
    add("--world4-links", default="1gbit", help="links of the world-4 runs")
    add("--freeze", type=int, default=None, help="freeze_step / var_freeze_step of the links' runs (default 5; --quick 2)")
    add("--steps", type=int, default=None, help="measured steps after the warm-up (default 12; --quick 3)")
    add("--precision", default="fp32", choices=list(PRECISION))
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=900.0, help="seconds per run")
    add("--curves", default=",".join(OPTIMIZERS), help="optimizers of the demo's loss curves; empty: none")
    add("--curve-steps", type=int, default=None, help="demo steps per optimizer (default 300; --quick 20)")
    add("--curve-freeze", type=int, default=None, help="the demo's freeze_step / var_freeze_step (default 60; --quick 5)")
    add("--no-links", action="store_true", help="only the loss curves (no root needed)")
    add("--no-curves", action="store_true", help="only the links' runs")
    add("--quick", action="store_true", help="tiny GPT, few steps: a smoke run")
    add("--out", default=None, help="JSON to write (default results/onebit[_quick].json)")
    args = parser.parse_args(argv)
    args.links = [] if args.no_links else _names(args.links, LINKS, "links")
    args.world2, args.world4 = _names(args.world2, OPTIMIZERS, "world2"), _names(args.world4, OPTIMIZERS, "world4")
    args.world4_links = _names(args.world4_links, LINKS, "world4-links")
    args.curves = [] if args.no_curves else _names(args.curves, OPTIMIZERS, "curves")
    quick = args.quick
    args.freeze = args.freeze if args.freeze is not None else (2 if quick else 5)
    args.steps = args.steps if args.steps is not None else (3 if quick else 12)
    args.curve_steps = args.curve_steps if args.curve_steps is not None else (20 if quick else 300)
    args.curve_freeze = args.curve_freeze if args.curve_freeze is not None else (5 if quick else 60)
    args.out = Path(args.out or RESULTS / ("onebit_quick.json" if quick else "onebit.json"))
    return args


def _curves(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.curves:
        return None
    demo = json.loads((DEMO / "ds_config.json").read_text())["optimizer"]["params"]
    configs = optimizer_configs(demo, {**demo, "lr": DEMO_LAMB_LR}, args.curve_freeze)
    with tempfile.TemporaryDirectory(prefix="onebit_demo_") as root:
        png = args.out.with_name(args.out.stem + "_loss.png")
        out = run_curves({n: configs[n] for n in args.curves}, BASELINE_OF, Path(root), args.curve_steps,
                         10 if args.quick else 50, png, args.timeout)
    return {"steps": args.curve_steps, "freeze_step": args.curve_freeze, "png": png.name, **out}  # beside the JSON


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    if args.links:
        require_hosts("onebit.py --links (--no-links: only the demo's curves)")
    load, started, tree = LoadSampler(), time.perf_counter(), _tree_state()
    measured = run_links(args) if args.links else {"results": {}, "links": {}}
    curves = _curves(args)
    model = _spec(args, {})["model"]
    report = {
        "benchmark": "onebit",
        "setup": {"quick": args.quick, "tree": tree, "freeze_step": args.freeze, "warmup_steps": args.freeze + 1,
                  "measured_steps": args.steps, "seed": args.seed, "precision": args.precision, "zero_stage": 0,
                  "model": {**model, **parameter_counts(_spec(args, {}))}, "ranks_per_host": 1,
                  "world4_links": args.world4_links, "links": measured["links"],
                  "wall_s": round(time.perf_counter() - started, 1), "environment": environment(),
                  "load_average": load.summary()},
        "key_figures": key_figures(measured["results"], curves),
        "results": measured["results"],
        "curves": curves,
    }
    write_report(report, args.out)
    if measured["results"]:
        print_table(report)
        log(f"wrote {args.out} and {plot(report, args.out.with_suffix('.png'))}")
    if curves:
        log(f"loss curves: {curves['plot']}")
    return report


if __name__ == "__main__":
    main()
