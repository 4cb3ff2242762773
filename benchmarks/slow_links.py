"""Training over slow links: ZeRO-3 variants at world size 4 on namespace "hosts" joined by a shaped switch.

shardwise's multi-node LoRA case: a few single-GPU servers on ordinary Ethernet. Plain ZeRO-3 all-gathers
every weight, frozen ones included, over the network in every forward and backward; node-local frozen
weights and ZeRO++ cut that traffic. This measures it on one machine: four network namespaces on one Linux
bridge (`_netns.py`), every link shaped to a rate, one rank per host (4x1) or two (2x2, for hpZ), gloo over
the hosts' veths, each host with its own /dev/shm (so ranks of different hosts cannot use shared memory).

Per run (model x configuration x link): `--warmup` steps, then `--steps` measured ones; per step the
slowest rank's wall time, the loss (mean over ranks) against a single-process oracle, the bytes the
engine's `comm.stats` counted per group and op, and the bytes each host's interface sent and received.
A configuration the library refuses (a key it does not know yet) is a row with its error, not a crash.

    sudo .venv/bin/python benchmarks/slow_links.py                                  # everything
    sudo .venv/bin/python benchmarks/slow_links.py --quick --links unshaped,1gbit   # smoke run (zero3)
    .venv/bin/python benchmarks/slow_links.py --estimate '{"link_gbit": [10, 25, 32]}'   # the model only

The ranks run this checkout's src/ (their PYTHONPATH says so); the parent imports no shardwise.

Writes benchmarks/results/slow_links.json (`--quick`: slow_links_quick.json) and a PNG beside it, and
prints a table. See benchmarks/README.md ("Training over slow links").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, LoadSampler, environment, log, write_report
from _netns import INTERFACE, switched_hosts
from _netns_ranks import require_hosts, run_ranks
from _slow_links_models import MODELS, QUICK_MODELS, oracle_losses, parameter_counts
from _slow_links_report import estimate, expected_tx_bytes, model_ratio_issued, plot, print_estimate, print_table

WORLD = 4


@dataclass(frozen=True)
class Config:
    hosts: int
    ranks_per_host: int
    zero: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def layout(self) -> str:
        return f"{self.hosts}x{self.ranks_per_host}"


_PLAIN = {"node_local_frozen_weights": False}  # ZeRO++ rows compare against plain ZeRO-3, not node-local
CONFIGS: dict[str, Config] = {
    "defaults": Config(4, 1, {}, "the library's defaults: node-local frozen weights for the LoRA model"),
    "zero3": Config(4, 1, dict(_PLAIN), "plain ZeRO-3: frozen weights partitioned over all 4 ranks"),
    "node-local": Config(4, 1, {"node_local_frozen_weights": True}, "frozen weights partitioned within a node"),
    "qwz": Config(4, 1, {**_PLAIN, "zero_quantized_weights": True}, "int8 weight all-gathers"),
    "qgz": Config(4, 1, {**_PLAIN, "zero_quantized_gradients": True}, "4-bit gradient reduce-scatter"),
    "defaults-2x2": Config(2, 2, {}, "the library's defaults on hpz's layout"),
    "zero3-2x2": Config(2, 2, dict(_PLAIN), "plain ZeRO-3 on hpz's layout (its reference)"),
    "hpz": Config(2, 2, {**_PLAIN, "zero_hpz_partition_size": 2}, "secondary weight partition within a node"),
    "zeropp": Config(2, 2, {**_PLAIN, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                            "zero_quantized_gradients": True}, "hpz + qwz + qgz"),
}
DEFAULT_CONFIGS = [c for c in CONFIGS if not c.startswith("defaults")]
# name -> (tc rate, one-way delay in ms); the delay needs netem (see _netns.py)
LINKS: dict[str, tuple[str | None, float]] = {"unshaped": (None, 0.0), "10gbit": ("10gbit", 0.05),
                                               "1gbit": ("1gbit", 0.2)}


def summarize(ranks: list[dict[str, Any]], name: str, oracle: list[float] | None, warmup: int,
              counts: dict[str, int]) -> dict[str, Any]:
    """One run's row: the slowest rank per step, the mean loss against the oracle, traffic per host."""
    config = CONFIGS[name]
    steps = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))]
    cpu = [max(ts) for ts in zip(*(r["cpu_times_s"] for r in ranks))]
    losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in ranks))]
    first_of_host = [ranks[h * config.ranks_per_host] for h in range(config.hosts)]
    interface = [{k: v / len(steps) for k, v in r["interface"].items()} for r in first_of_host]
    row: dict[str, Any] = {
        "layout": config.layout,
        "step_time_s_median": round(statistics.median(steps), 4), "step_time_s_min": round(min(steps), 4),
        "step_times_s": [round(t, 4) for t in steps], "cpu_time_s_median": round(statistics.median(cpu), 4),
        "losses": [round(x, 6) for x in losses], "warmup_steps": warmup,
        "comm_per_step_rank0": ranks[0]["comm_per_step"], "group_sizes": ranks[0]["group_sizes"],
        "interface_per_step_per_host": [{k: round(v) for k, v in i.items()} for i in interface],
        "inter_host_tx_mb_per_step": round(statistics.fmean(i["tx_bytes"] for i in interface) / 1e6, 3),
        "inter_host_rx_mb_per_step": round(statistics.fmean(i["rx_bytes"] for i in interface) / 1e6, 3),
    }
    if oracle is not None:
        row["oracle_losses"] = [round(x, 6) for x in oracle]
        row["oracle_max_rel_gap"] = float(f"{max(abs(a - b) / abs(b) for a, b in zip(losses, oracle)):.3g}")
    row.update(_wire_check(row, config, [i["tx_bytes"] for i in interface]))
    if name.startswith("defaults"):  # which scheme the defaults are depends on the library's version
        row["model_ratio_issued_if"] = {s: model_ratio_issued(row, s, counts, config.hosts, config.ranks_per_host)
                                        for s in ("zero3", "node-local")}
    else:
        scheme = name.removesuffix("-2x2")
        row["model_ratio_issued"] = model_ratio_issued(row, scheme, counts, config.hosts, config.ranks_per_host)
    return row


def _wire_check(row: dict[str, Any], config: Config, sent: list[float]) -> dict[str, Any]:
    """What each host sent against what gloo's algorithms send for the comm stats' collectives ([Note: bytes
    on the wire] in _slow_links_report.py), and against the bytes the "data" group issued."""
    host_of = [r // config.ranks_per_host for r in range(WORLD)]
    expected = expected_tx_bytes(row["comm_per_step_rank0"], row["group_sizes"], host_of)
    data = sum(op["bytes"] for op in row["comm_per_step_rank0"].get("data", {}).values())
    return {"expected_tx_mb_per_step_per_host": [round(e / 1e6, 3) for e in expected],
            "tx_over_expected_per_host": [round(m / e, 4) if e else None for m, e in zip(sent, expected)],
            "tx_over_data_group_bytes": round(statistics.fmean(sent) / data, 4) if data else None}


def _spec(model: str, quick: bool, args: argparse.Namespace, config: Config) -> dict[str, Any]:
    return {"model": (QUICK_MODELS if quick else MODELS)[model], "seed": args.seed, "warmup": args.warmup,
            "steps": args.steps, "zero": {**json.loads(args.zero), **config.zero}, "interface": INTERFACE}


def _check_names(args: argparse.Namespace) -> None:
    for name, table in (("configs", CONFIGS), ("links", LINKS), ("models", MODELS)):
        unknown = [x for x in getattr(args, name).split(",") if x not in table]
        if unknown:
            raise SystemExit(f"--{name}: each of {','.join(table)}; got {','.join(unknown)}.")


def _oracles(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Per model: the oracle's losses over every step, and the parameter counts."""
    oracles, counts = {}, {}
    for model in args.models.split(","):
        spec = _spec(model, args.quick, args, CONFIGS["zero3"])
        counts[model] = parameter_counts(spec)
        started = time.perf_counter()
        oracles[model] = oracle_losses(spec, WORLD, args.warmup + args.steps)
        log(f"[{model}] oracle: {time.perf_counter() - started:.1f} s")
    return oracles, counts


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every (link, model, configuration): hosts are made once per link, a run gets a fresh master port."""
    models, configs, links = args.models.split(","), args.configs.split(","), args.links.split(",")
    oracles, counts = _oracles(args)
    results: dict[str, Any] = {m: {c: {} for c in configs} for m in models}
    shaping, port = {}, 29700
    with tempfile.TemporaryDirectory(prefix="slow_links_") as root:
        for link in links:
            with switched_hosts(max(CONFIGS[c].hosts for c in configs), *LINKS[link]) as net:
                for model, name in ((m, c) for m in models for c in configs):
                    config, spec, port = CONFIGS[name], _spec(model, args.quick, args, CONFIGS[name]), port + 1
                    tmp = Path(root) / f"{link}-{model}-{name}"
                    tmp.mkdir()
                    started = time.perf_counter()
                    ranks = run_ranks(net, spec, WORLD, config.ranks_per_host, tmp, port, args.timeout)
                    row = ranks if isinstance(ranks, dict) else summarize(ranks, name, oracles[model], args.warmup,
                                                                          counts[model])
                    row.update(zero=spec["zero"], wall_s=round(time.perf_counter() - started, 1))
                    results[model][name][link] = row
                    outcome = row["error"][:100] if "error" in row else f"{row['step_time_s_median']} s/step"
                    log(f"[{link} {model} {name}] {outcome} (run: {row['wall_s']} s)")
                shaping[link] = {**net.shaping.__dict__, "qdisc_counters_per_host": net.qdisc_stats()}
    return {"results": results, "links": shaping, "oracles": oracles, "counts": counts}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="lora,full", help="of " + ",".join(MODELS))
    parser.add_argument("--configs", default=None, help=f"of {','.join(CONFIGS)} (default: all but defaults*)")
    parser.add_argument("--links", default=",".join(LINKS), help="of " + ",".join(LINKS))
    parser.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 2; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 5; --quick 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero", default="{}", metavar="JSON",
                        help="zero_optimization keys for every configuration (a configuration's own keys win), "
                             'e.g. \'{"stage3_max_reuse_distance": 0}\' to re-gather weights in the backward')
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps: a smoke run")
    parser.add_argument("--out", default=None, help="JSON to write (default results/slow_links[_quick].json)")
    parser.add_argument("--estimate", nargs="?", const="{}", default=None, metavar="JSON",
                        help="print the analytical model's figures only (JSON overrides its inputs) and exit")
    args = parser.parse_args(argv)
    args.configs = args.configs or ("zero3" if args.quick else ",".join(DEFAULT_CONFIGS))
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    args.out = Path(args.out or RESULTS / ("slow_links_quick.json" if args.quick else "slow_links.json"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = _parse(argv)
    if args.estimate is not None:
        print_estimate(estimate(**json.loads(args.estimate)))
        return None
    _check_names(args)
    require_hosts("slow_links.py")
    load, started = LoadSampler(), time.perf_counter()
    measured = run_all(args)
    specs = {m: _spec(m, args.quick, args, CONFIGS["zero3"])["model"] for m in args.models.split(",")}
    report = {
        "benchmark": "slow_links",
        "setup": {"world": WORLD, "quick": args.quick, "warmup": args.warmup, "steps": args.steps, "seed": args.seed,
                  "zero_overrides": json.loads(args.zero),
                  "models": {m: {**s, **measured["counts"][m]} for m, s in specs.items()},
                  "configs": {c: {**CONFIGS[c].__dict__, "layout": CONFIGS[c].layout} for c in args.configs.split(",")},
                  "links": measured["links"], "wall_s": round(time.perf_counter() - started, 1),
                  "environment": environment(), "load_average": load.summary()},
        "results": measured["results"],
        "oracle_losses": measured["oracles"],
    }
    write_report(report, args.out)
    print_table(report)
    log(f"wrote {args.out} and {plot(report, args.out.with_suffix('.png'))}")
    return report


if __name__ == "__main__":
    main()
