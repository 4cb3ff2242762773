"""ZeRO stages 0-3 against DeepSpeed 0.19, torch DDP, PyTorch FSDP2 and the compute floor.

World size 2 on CPU (gloo, one intra-op thread per rank), the demo GPT (examples/demo/model.py) at
sequence length 128, micro-batch 8, AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1 on matrices),
no gradient clipping (set explicitly: DeepSpeed's default is 1.0), no accumulation.

| config | what runs |
| --- | --- |
| shardwise-S | `shardwise.initialize`, `zero_optimization.stage` S (0-3), torch's fused AdamW |
| deepspeed-S | `deepspeed.initialize` 0.19, stage S (1-3), the same config (its CPU FusedAdam op) |
| ddp | `DistributedDataParallel` + `torch.optim.AdamW(fused=True)` |
| fsdp2 | `fully_shard` on every block, then on the root, + `torch.optim.AdamW` (fused) over the DTensors |
| floor | `world` processes at once, same thread count, no communication in the timed steps (an untimed barrier starts each step together): forward + backward of one rank's micro-batch, then AdamW over all parameters (`floor-full`: the floor of DDP and stage 0) and, timed apart, AdamW over one flat tensor of 1/world of the elements (`floor-sharded`: the floor of stages 1-3 and FSDP2, which step only their shard); the slower rank's time per step, as for the libraries |
| floor-alone | the same work in ONE process with the machine to itself (reference: the floor of earlier results, before the ranks' sharing of cores, caches and memory bandwidth was counted) |

Every configuration runs in its own freshly spawned processes; `--rounds` repeats all of them, in
reversed order every other round. Ratios come as medians pooled over all rounds and as `paired`: the median
over rounds of the two configurations' ratio within one round, which cancels the machine's drift between
rounds. Per step the slower rank's wall time counts (forward + backward +
step), and its CPU time (all threads of the process). Model-state bytes per rank for shardwise:
`shardwise.zero.measured_bytes(engine.strategy)` against `shardwise.zero.formula_bytes`.

    .venv/bin/python benchmarks/zero_stages.py                                  # without DeepSpeed
    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python benchmarks/zero_stages.py  # with it
    ... --presets bench100m --configs shardwise-1,shardwise-2,deepspeed-1,deepspeed-2,floor

Prints the JSON and writes benchmarks/results/zero_stages.json (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
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
    merge_ranks,
    paired_ratio,
    pool_steps,
    ratio,
    rss_mib,
    spawn,
    token_batches,
    verdict,
    write_report,
)

WORLD = 2
CONFIGS = ("floor", "floor-alone", "shardwise-0", "shardwise-1", "shardwise-2", "shardwise-3", "shardwise-3-reshard",
           "deepspeed-1", "deepspeed-2", "deepspeed-3", "ddp", "fsdp2")
RESHARD = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 409_600}
"""`shardwise-3-reshard`: stage 3 with FSDP2's gather policy, for the memory comparison with it. FSDP2 frees a
block's parameters after its forward and gathers one block ahead; `ds_config`'s DeepSpeed defaults (reuse
distance and live parameters 1e9) keep every gathered parameter from forward to backward instead. Here units
are released after forward and the prefetch window is one unit (bench33m's largest, a 320x1280 MLP weight)."""
# (warm-up, timed) steps per preset: keeps the default run near five minutes on two cores
STEPS = {"demo": (3, 10), "bench33m": (1, 3), "bench100m": (1, 3)}
PERSISTENCE = 100_000  # stage3_param_persistence_threshold, the same for both libraries (both defaults)
EXTRA = ("model_state", "parameters", "optimizer", "threads")


def ds_config(stage: int, micro: int, zero_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config both libraries get (`zero_extra` adds zero_optimization keys, e.g. offload_optimizer)."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                            "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=PERSISTENCE, stage3_prefetch_bucket_size=50_000_000,
                    stage3_max_live_parameters=1_000_000_000, stage3_max_reuse_distance=1_000_000_000)
    zero.update(zero_extra or {})
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told otherwise
            "steps_per_print": 1_000_000, "optimizer": {"type": "AdamW", "params": ADAMW}, "zero_optimization": zero}


def _torch_adamw(params: Any) -> tuple[Any, str]:
    import torch

    kwargs = {**ADAMW, "betas": tuple(ADAMW["betas"])}
    try:
        return torch.optim.AdamW(params, **kwargs, fused=True), "torch AdamW fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, **kwargs, foreach=True), "torch AdamW foreach"


def _build(kind: str, model: Any, micro: int, zero_extra: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """(train_step, info) for one configuration."""
    import torch
    import torch.distributed as dist

    if kind in ("ddp", "fsdp2"):
        if not dist.is_initialized():  # zero_interleaved.py builds several configurations in one process
            dist.init_process_group("gloo")
        if kind == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        opt, opt_name = _torch_adamw(model.param_groups())  # after fully_shard: the DTensor parameters

        def plain_step(x: Any, y: Any) -> None:
            wrapped(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return plain_step, {"optimizer": opt_name}
    library, stage, *variant = kind.split("-")
    if variant == ["reshard"]:
        zero_extra = {**(zero_extra or {}), **RESHARD}
    if library == "deepspeed":
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        import shardwise as ds
    engine, optimizer, _, _ = ds.initialize(model=model, model_parameters=model.param_groups(),
                                            config=ds_config(int(stage), micro, zero_extra))

    def engine_step(x: Any, y: Any) -> None:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return engine_step, {"optimizer": type(optimizer).__name__, "engine": engine}


def _model_state(engine: Any, numel: int, stage: int) -> dict[str, Any]:
    from shardwise.zero import formula_bytes, measured_bytes

    measured, formula = measured_bytes(engine.strategy), formula_bytes(numel, WORLD, stage)
    parts = ("params", "grads", "optimizer", "total")
    return {"optimizer_offloaded": measured.optimizer_offloaded, "device_bytes": measured.device,
            "host_bytes": measured.host,"measured_bytes": {p: getattr(measured, p) for p in parts},
            "formula_bytes": {p: getattr(formula, p) for p in parts},
            "measured_pct_of_formula": {p: round(100 * getattr(measured, p) / getattr(formula, p), 2)
                                        for p in parts if getattr(formula, p)}}


def _rank_main(rank: int, kind: str, preset_name: str, seq_len: int, micro: int, warmup: int, steps: int,
               threads: int, zero_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if kind.startswith("deepspeed"):
        import deepspeed  # noqa: F401  - counted in the import RSS, like shardwise's import below
    elif kind.startswith("shardwise"):
        import shardwise.zero  # noqa: F401
    from examples.demo.model import GPT, preset

    rss_after_import = rss_mib()
    torch.manual_seed(0)
    model = GPT(preset(preset_name, seq_len=seq_len))
    numel = model.num_parameters()
    batches = token_batches(model.cfg.vocab_size, micro, seq_len, warmup + steps, rank)
    train_step, info = _build(kind, model, micro, zero_extra)
    torch.set_num_threads(threads)  # whatever the library chose at init
    times, cpu_times = [], []
    for x, y in batches:
        start, cpu_start = time.perf_counter(), time.process_time()
        train_step(x, y)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    dist.barrier()
    out = {"step_times_s": times[warmup:], "cpu_times_s": cpu_times[warmup:], "peak_rss_mib": rss_mib(),
           "rss_mib_after_import": rss_after_import, "threads": torch.get_num_threads(), "parameters": numel,
           "optimizer": info["optimizer"]}
    if kind.startswith("shardwise"):
        out["model_state"] = _model_state(info["engine"], numel, int(kind.split("-")[1]))
    return out


def _floor_main(rank: int, preset_name: str, seq_len: int, micro: int, warmup: int, steps: int,
                threads: int, lockstep: bool) -> dict[str, Any]:
    """The work one rank must do whatever the library, with no communication inside the timed steps.

    With `lockstep` every rank of the world runs it at once (as the libraries' ranks share the machine's cores,
    caches and memory bandwidth) and an untimed barrier starts each step together; without it one process runs
    alone on the machine."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if lockstep:
        dist.init_process_group("gloo")
    from examples.demo.model import GPT, preset

    rss_after_import = rss_mib()
    torch.manual_seed(0)
    model = GPT(preset(preset_name, seq_len=seq_len))
    numel = model.num_parameters()
    opt, opt_name = _torch_adamw(model.param_groups())
    shard = torch.nn.Parameter(torch.randn(-(-numel // WORLD)) * 0.02)  # one rank's flat shard (stages 1-3)
    shard.grad = torch.randn_like(shard) * 1e-3
    shard_opt, _ = _torch_adamw([shard])
    parts: dict[str, list[float]] = {k: [] for k in ("fwd_bwd", "adam_full", "adam_shard")}
    cpu_parts: dict[str, list[float]] = {k: [] for k in parts}

    def timed(key: str, fn: Any) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        parts[key].append(time.perf_counter() - start)
        cpu_parts[key].append(time.process_time() - cpu_start)

    for x, y in token_batches(model.cfg.vocab_size, micro, seq_len, warmup + steps, rank):
        if lockstep:
            dist.barrier()
        timed("fwd_bwd", lambda x=x, y=y: model(x, y).backward())
        timed("adam_full", lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
        timed("adam_shard", shard_opt.step)

    def per_step(p: dict[str, list[float]], adam: str) -> list[float]:
        return [a + b for a, b in zip(p["fwd_bwd"][warmup:], p[adam][warmup:])]

    return {"full": {"step_times_s": per_step(parts, "adam_full"), "cpu_times_s": per_step(cpu_parts, "adam_full")},
            "sharded": {"step_times_s": per_step(parts, "adam_shard"), "cpu_times_s": per_step(cpu_parts, "adam_shard")},
            "parts_s_median": {k: round(statistics.median(v[warmup:]), 4) for k, v in parts.items()},
            "parts_cpu_s_median": {k: round(statistics.median(v[warmup:]), 4) for k, v in cpu_parts.items()},
            "peak_rss_mib": rss_mib(), "rss_mib_after_import": rss_after_import, "threads": torch.get_num_threads(),
            "parameters": numel, "optimizer": opt_name}


def run_config(kind: str, args: argparse.Namespace, preset_name: str,
               zero_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    warmup, steps = (args.warmup, args.steps) if args.steps else STEPS.get(preset_name, (2, 5))
    common = (preset_name, args.seq_len, args.micro_batch, warmup, steps, args.threads)
    if kind in ("floor", "floor-alone"):
        lockstep = kind == "floor"
        result = spawn(_floor_main, WORLD if lockstep else 1, (*common, lockstep), args.timeout)
        if isinstance(result, dict):
            return result
        r = result[0]
        shared = {"parts_s_median": r["parts_s_median"], "parts_cpu_s_median": r["parts_cpu_s_median"],
                  "threads": r["threads"], "parameters": r["parameters"], "optimizer": r["optimizer"]}
        return {part: merge_ranks([{**rank[part], "peak_rss_mib": rank["peak_rss_mib"],
                                    "rss_mib_after_import": rank["rss_mib_after_import"]} for rank in result]) | shared
                for part in ("full", "sharded")}
    result = spawn(_rank_main, WORLD, (kind, *common, zero_extra), args.timeout)
    if isinstance(result, dict):
        return result
    return merge_ranks(result, EXTRA) | {"model_state_per_rank": [r.get("model_state") for r in result]}


FLOOR_OF = {0: "floor-full", 1: "floor-sharded", 2: "floor-sharded", 3: "floor-sharded"}
TARGETS = [(f"shardwise-{s}", f"deepspeed-{s}", 0.9) for s in (1, 2, 3)]
TARGETS += [(f"shardwise-{s}", floor, 1.10 if s == 3 else 1.05) for s, floor in FLOOR_OF.items()]
TARGETS += [("shardwise-3", "fsdp2", 1.0), ("shardwise-3-reshard", "fsdp2", 1.0), ("shardwise-0", "ddp", 1.05)]
"""(a, b, target): the ratios the brief asks for (this script and zero_interleaved.py)."""
REFERENCES = [("ddp", "floor-full"), ("fsdp2", "floor-sharded")] + [(f"deepspeed-{s}", "floor-sharded") for s in (1, 2, 3)]
"""(a, b): the peers' ratios, shown for reference."""


def _paired(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """`paired_ratio` of the two configurations' medians round by round (None without both)."""
    key = "step_time_s_median_per_round"
    if not isinstance(a, dict) or not isinstance(b, dict) or key not in a or key not in b:
        return None
    return paired_ratio(a[key], b[key])


def compare(rows: dict[str, Any]) -> dict[str, Any]:
    """The ratios the brief asks for, each against its target."""
    ok = {k: v for k, v in rows.items() if isinstance(v, dict) and "error" not in v}
    metrics = {"median": "step_time_s_median", "fastest": "step_time_s_min", "cpu": "cpu_time_s_median"}
    references = REFERENCES + [(f"shardwise-{s}", floor.replace("floor", "floor-alone")) for s, floor in FLOOR_OF.items()]
    references += [(floor, floor.replace("floor", "floor-alone")) for floor in ("floor-full", "floor-sharded")]
    out: dict[str, Any] = {}
    for a, b, target in TARGETS:
        for name, key in metrics.items():
            out[f"{a}/{b} {name}"] = verdict(ratio(ok.get(a), ok.get(b), key), target)
        out[f"{a}/{b} paired"] = verdict(_paired(ok.get(a), ok.get(b)), target)
    for a, b in references:
        for name, key in metrics.items():
            out[f"{a}/{b} {name} (reference)"] = ratio(ok.get(a), ok.get(b), key)
        out[f"{a}/{b} paired (reference)"] = _paired(ok.get(a), ok.get(b))
    for ours, stage in [(f"shardwise-{s}", s) for s in (0, 1, 2, 3)] + [("shardwise-3-reshard", 3)]:
        for other in ("ddp", "fsdp2", f"deepspeed-{stage}"):
            for key, label in (("peak_rss_mib_per_rank", "peak RSS"), ("rss_growth_mib_per_rank", "RSS growth")):
                value = ratio(ok.get(ours), ok.get(other), key)
                if value is not None:
                    out[f"{ours}/{other} {label}"] = value
    return out


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    """The options of the setup this script and zero_interleaved.py share."""
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (and for the floor)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--zero", type=json.loads, default=None, metavar="JSON",
                        help="zero_optimization keys set for shardwise and DeepSpeed alike (FSDP2, DDP: unchanged)")


def setup_of(args: argparse.Namespace) -> dict[str, Any]:
    """The shared setup as the report records it."""
    return {"world_size": WORLD, "device": "cpu", "backend": "gloo", "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "threads_per_rank": args.threads, "optimizer": {"type": "AdamW", **ADAMW},
            "gradient_clipping": 0.0, "stage3_param_persistence_threshold": PERSISTENCE,
            "zero_overrides": args.zero, **environment()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="demo,bench33m", help="comma-separated presets of examples/demo/model.py")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    add_setup_args(parser)
    parser.add_argument("--steps", type=int, default=0,
                        help="timed steps after --warmup; 0: per preset (demo 3+10, bench33m and bench100m 1+3)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every configuration, order reversed every other round")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(RESULTS / "zero_stages.json"))
    args = parser.parse_args(argv)

    load = LoadSampler()
    with_ds = has_deepspeed()
    report: dict[str, Any] = {
        "benchmark": "zero_stages",
        "setup": {**setup_of(args), "rounds": args.rounds,
                  "steps": {p: (args.warmup, args.steps) if args.steps else STEPS.get(p) for p in args.presets.split(",")}},
        "presets": {},
    }
    for preset_name in args.presets.split(","):
        kinds = [k for k in args.configs.split(",") if with_ds or not k.startswith("deepspeed")]
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for round_index in range(args.rounds):
            for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                started = time.perf_counter()
                runs[kind].append(run_config(kind, args, preset_name, args.zero))
                last = runs[kind][-1]
                shown = last.get("error") or (statistics.median(last["step_times_s"]) if "step_times_s" in last
                                              else statistics.median(last["sharded"]["step_times_s"]))
                log(f"[{preset_name} round {round_index}] {kind}: {shown} ({time.perf_counter() - started:.0f} s)")
        rows: dict[str, Any] = {}
        for kind, kind_runs in runs.items():
            if kind.startswith("floor"):
                for part in ("full", "sharded"):
                    pieces = [r.get(part, r) for r in kind_runs]
                    rows[f"{kind}-{part}"] = pool_steps(pieces, ("parts_s_median", "parts_cpu_s_median", "threads",
                                                                "parameters", "optimizer"))
            else:
                rows[kind] = pool_steps(kind_runs, ("threads", "parameters", "optimizer", "model_state_per_rank"))
        if not with_ds and any(k.startswith("deepspeed") for k in args.configs.split(",")):
            rows["deepspeed"] = "not installed"
        rows["ratios"] = compare(rows)
        report["presets"][preset_name] = rows
    report["setup"]["load_average"] = load.summary()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
