"""Pipeline parallelism measured: the bubble per schedule, the activations each stage holds, and the step
time of 2 pipeline stages against 2 data-parallel replicas. CPU, gloo, spawned ranks, the real
`PipelineEngine.train_batch`; every part interleaves its configurations in one set of processes.

1. `bubble` (p = 2 and 4 ranks): "gpipe", "1f1b" and "interleaved_1f1b" (2 chunks, where m % p == 0) at
   m = 4, 8, 16 micro-batches, on layers whose compute is a timed sleep (forward F per stage, backward 2F;
   `_pipeline_layers.sleep_specs`), so that 4 ranks on 2 cores measure the schedule, not the cores.
   With `executor.record_timeline` every instruction is timed (time.perf_counter: CLOCK_MONOTONIC, one
   clock for every process on the host). The batch's makespan runs from the first instruction any stage
   starts to the last one any stage ends before REDUCE_GRADS (the gradient reduction and optimizer step
   tail is reported apart, `tail_ms`); stage s's bubble is 1 - (its time in FORWARD and BACKWARD) /
   makespan: the simulator's definition (idle / makespan per stage; their mean is the bubble fraction).
   Beside it: the closed form as a fraction of the makespan, (p-1)/(m+p-1) for GPipe and 1F1B and
   (p-1)/(v*m+p-1) for interleaved (v chunks); Megatron's form, bubble time over ideal time, is
   (p-1)/m and (p-1)/(v*m) (`theory_over_ideal`); and `shardwise.pipeline.simulate` on the same
   schedule (free communication). Medians over `--reps` batches per configuration.
2. `memory` (p = 2, m = 8): each stage's `engine.last_batch.peak_in_flight` (1F1B holds at most p - s
   micro-batches on stage s, GPipe m) for gpipe and 1f1b on tests/pipeline_models.py's Linear/Block/Head at
   a real width, and the peak live bytes of tensors saved for backward during train_batch
   (`_pipeline_layers.SavedBytes`, parameters excluded), beside one micro-batch's saved bytes of that stage.
   Part 1 also reports peak_in_flight for every configuration it runs.
3. `step` (world 2): the bench GPT (examples/demo/model.py, `--preset`) as a PipelineModule of LayerSpecs
   (`_pipeline_layers.gpt_specs`), pp=2 with 1F1B over m micro-batches, against the plain engine at dp=2
   with m/2 accumulation steps: the same micro-batch and global batch (micro * m), ZeRO-1 and AdamW with
   zero_stages.py's config. The two alternate step by step (order flipping each round) after an untimed
   barrier; per step the slower rank's wall time; medians, spread, the paired ratio pp/dp.

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline_parallel.py                  # ~4 min on 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/pipeline_parallel.py --quick          # ~1 min, not for quoting
    ... --parts bubble --stages 2 --micro-batches 4,8 --reps 3

Writes benchmarks/results/pipeline_parallel.json (`--quick`: pipeline_parallel_quick.json).
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
    RESULTS,
    LoadSampler,
    environment,
    log,
    paired_ratio,
    spawn,
    token_batches,
    write_report,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CHUNKS = 2  # of the interleaved schedule
COMPUTE = ("forward", "backward")
TAIL = ("reduce_grads", "optimizer_step")


# --- what each rank reports about one train_batch -------------------------------------------------------
def batch_record(engine: Any) -> dict[str, Any]:
    """One stage's share of the last train_batch: its compute time, where its pre-tail instructions start
    and end, the tail's length, and the in-flight peak."""
    timeline = [(ins.op.value, start, end) for ins, start, end in engine.last_batch.timeline]
    pre = [t for t in timeline if t[0] not in TAIL]
    compute = [t for t in pre if t[0] in COMPUTE]
    return {"stage": engine.stage_id, "start": pre[0][1], "end": pre[-1][2],
            "busy": sum(end - start for _, start, end in compute),
            "forward": statistics.mean(end - start for op, start, end in compute if op == "forward"),
            "backward": statistics.mean(end - start for op, start, end in compute if op == "backward"),
            "tail": sum(end - start for op, start, end in timeline if op in TAIL),
            "peak_in_flight": engine.last_batch.peak_in_flight}


def bubbles(stages: list[dict[str, Any]]) -> tuple[float, list[float]]:
    """(makespan, each stage's bubble) of one batch from every stage's record, on the host's one clock."""
    by_stage = sorted(stages, key=lambda r: r["stage"])
    makespan = max(r["end"] for r in by_stage) - min(r["start"] for r in by_stage)
    return makespan, [1 - r["busy"] / makespan for r in by_stage]


def _median(values: list[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)


# --- part 1: the bubble on sleeping layers --------------------------------------------------------------
def _bubble_rank(rank: int, stages: int, configs: list[tuple[str, int]], forward_ms: float, warmup: int,
                 reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _pipeline_layers import SLEEP_WIDTH, mse, sleep_specs

    import shardwise
    from shardwise.pipe import PipelineModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engines = {}
    for name, m in configs:
        module = PipelineModule(sleep_specs(stages, forward_ms), num_stages=stages, loss_fn=mse, seed_layers=True,
                                partition_method="uniform", num_chunks=CHUNKS if name == "interleaved_1f1b" else 1)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
                  "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "pipeline": {"schedule": name}}
        engine, _, _, _ = shardwise.initialize(model=module, model_parameters=module.parameters(), config=config)
        engine.executor.record_timeline = True
        engines[(name, m)] = engine
    torch.manual_seed(0)  # the first stage's inputs and the last stage's labels from one list
    batch = [(torch.randn(1, SLEEP_WIDTH), torch.randn(1, SLEEP_WIDTH)) for _ in range(max(m for _, m in configs))]
    records: dict[str, list[dict[str, Any]]] = {f"{n}/{m}": [] for n, m in configs}
    for i in range(warmup + reps):
        for name, m in configs[i % len(configs):] + configs[: i % len(configs)]:
            dist.barrier()
            engines[(name, m)].train_batch(iter(batch[:m]))
            if i >= warmup:
                records[f"{name}/{m}"].append(batch_record(engines[(name, m)]))
    dist.barrier()
    return records


def _bubble_row(name: str, stages: int, m: int, per_rank: list[list[dict[str, Any]]], forward_ms: float
                ) -> dict[str, Any]:
    from shardwise.pipeline import (
        gpipe,
        interleaved_1f1b,
        one_f_one_b,
        simulate,
        theoretical_bubble_fraction,
    )

    v = CHUNKS if name == "interleaved_1f1b" else 1
    schedule = {"gpipe": lambda: gpipe(stages, m), "1f1b": lambda: one_f_one_b(stages, m),
                "interleaved_1f1b": lambda: interleaved_1f1b(stages, m, v)}[name]()
    sim = simulate(schedule, forward_time=forward_ms, backward_time=2 * forward_ms)
    reps = [bubbles(list(records)) for records in zip(*per_rank)]
    per_stage = [_median([b[s] for _, b in reps]) for s in range(stages)]
    means = [statistics.mean(b) for _, b in reps]
    records = [r for rank in per_rank for r in rank]
    return {"schedule": name, "p": stages, "m": m, "chunks": v,
            "bubble_per_stage": per_stage, "bubble_mean": _median(means), "bubble_max": max(per_stage),
            "bubble_mean_spread": [round(min(means), 4), round(max(means), 4)],
            "theory": round(theoretical_bubble_fraction(name, stages, m, v), 4),
            "theory_over_ideal": round((stages - 1) / (v * m), 4),
            "simulated": round(sim.bubble_fraction, 4),
            "simulated_per_stage": [round(i / sim.makespan, 4) for i in sim.idle_per_stage],
            "makespan_ms": _median([1000 * t for t, _ in reps], 2),
            "simulated_makespan_ms": round(sim.makespan, 2),
            "forward_ms_per_chunk": _median([1000 * r["forward"] for r in records], 3),
            "backward_ms_per_chunk": _median([1000 * r["backward"] for r in records], 3),
            "tail_ms": _median([1000 * r["tail"] for r in records], 3),
            "peak_in_flight_per_stage": [max(r["peak_in_flight"] for r in rank) for rank in
                                         sorted(per_rank, key=lambda rank: rank[0]["stage"])],
            "simulated_peak_in_flight_per_stage": list(sim.peak_in_flight)}


def run_bubble(args: argparse.Namespace) -> list[dict[str, Any]] | dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for p in args.stages:
        configs = [(n, m) for m in args.micro_batches for n in args.schedules
                   if n != "interleaved_1f1b" or m % p == 0]
        started = time.perf_counter()
        result = spawn(_bubble_rank, p, (p, configs, args.forward_ms, args.warmup, args.reps), args.timeout)
        log(f"[bubble p={p}] {len(configs)} configurations x {args.reps} reps: {time.perf_counter() - started:.0f} s")
        if isinstance(result, dict):
            return result
        rows += [_bubble_row(n, p, m, [r[f"{n}/{m}"] for r in result], args.forward_ms) for n, m in configs]
    return rows


# --- part 2: activations held per stage -----------------------------------------------------------------
def _memory_rank(rank: int, schedules: list[str], m: int, micro: int, width: int, blocks: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _pipeline_layers import SavedBytes, block_specs, mse

    import shardwise
    from shardwise.pipe import PipelineModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    in_width = out_width = 64
    g = torch.Generator().manual_seed(0)
    batch = [(torch.randn(micro, in_width, generator=g), torch.randn(micro, out_width, generator=g)) for _ in range(m)]
    out: dict[str, Any] = {}
    for name in schedules:
        module = PipelineModule(block_specs(width, blocks, in_width, out_width), num_stages=2, loss_fn=mse,
                                seed_layers=True, partition_method="uniform")
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
                  "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "pipeline": {"schedule": name}}
        engine, _, _, _ = shardwise.initialize(model=module, model_parameters=module.parameters(), config=config)
        counter = SavedBytes({p.untyped_storage().data_ptr() for p in engine.module.parameters()})
        for _ in range(2):  # the second batch is measured (the first negotiates shapes)
            counter.peak = 0
            with counter.hooks():
                engine.train_batch(iter(batch))
        one = SavedBytes(counter.exclude)
        x = batch[0][0] if engine.stage_id == 0 else torch.randn(micro, width, requires_grad=True)
        with one.hooks():
            y = engine.module(x)
            per_micro_batch = one.live
        del y
        out[name] = {"stage": engine.stage_id, "peak_in_flight": engine.last_batch.peak_in_flight,
                     "peak_saved_bytes": counter.peak, "saved_bytes_one_micro_batch": per_micro_batch,
                     "live_saved_bytes_after": counter.live}
        dist.barrier()
    return out


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    schedules = ["gpipe", "1f1b"]
    result = spawn(_memory_rank, 2, (schedules, args.memory_m, args.memory_micro, args.memory_width,
                                     args.memory_blocks), args.timeout)
    if isinstance(result, dict):
        return result
    rows = {}
    for name in schedules:
        ranks = sorted((r[name] for r in result), key=lambda r: r["stage"])
        rows[name] = {key: [r[key] for r in ranks] for key in ranks[0] if key != "stage"}
        rows[name]["peak_over_one_micro_batch"] = [round(r["peak_saved_bytes"] / r["saved_bytes_one_micro_batch"], 2)
                                                   for r in ranks]
        rows[name]["expected_peak_in_flight"] = [args.memory_m if name == "gpipe" else min(2 - s, args.memory_m)
                                                 for s in range(2)]
    rows["1f1b/gpipe peak saved bytes"] = [round(a / b, 3) for a, b in zip(rows["1f1b"]["peak_saved_bytes"],
                                                                            rows["gpipe"]["peak_saved_bytes"])]
    return {"setup": {"p": 2, "m": args.memory_m, "micro_batch": args.memory_micro, "width": args.memory_width,
                      "blocks": args.memory_blocks, "partition": "uniform"}, "results": rows}


# --- part 3: pp=2 against dp=2 on the bench GPT ------------------------------------------------------------
def _gpt_engines(preset_name: str, seq_len: int, micro: int, m: int) -> dict[str, Any]:
    """{"pp": PipelineEngine over 2 stages, "dp": Engine over 2 replicas}: the same GPT, micro-batch and
    global batch, zero_stages.py's ZeRO-1 config."""
    import torch
    from _pipeline_layers import gpt_loss, gpt_specs, init_like_gpt, param_groups
    from zero_stages import ds_config

    import shardwise
    from examples.demo.model import GPT, preset
    from shardwise.pipe import PipelineModule

    cfg = preset(preset_name, seq_len=seq_len)
    module = PipelineModule(gpt_specs(cfg), num_stages=2, loss_fn=gpt_loss, seed_layers=True)
    init_like_gpt(module)
    pp_config = {**ds_config(1, micro), "gradient_accumulation_steps": m, "pipeline": {"schedule": "1f1b"}}
    pp, _, _, _ = shardwise.initialize(model=module, model_parameters=param_groups(module), config=pp_config)
    pp.executor.record_timeline = True
    torch.manual_seed(0)
    gpt = GPT(cfg)
    dp, _, _, _ = shardwise.initialize(model=gpt, model_parameters=gpt.param_groups(),
                                       config={**ds_config(1, micro), "gradient_accumulation_steps": m // 2})
    return {"pp": pp, "dp": dp, "vocab": cfg.vocab_size}


def _step_rank(rank: int, preset_name: str, seq_len: int, micro: int, m: int, warmup: int, rounds: int
               ) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    built = _gpt_engines(preset_name, seq_len, micro, m)
    pp, dp = built["pp"], built["dp"]
    torch.set_num_threads(1)
    pipe_batch = token_batches(built["vocab"], micro, seq_len, m, 0)  # both stages read the one replica's data
    data_batch = token_batches(built["vocab"], micro, seq_len, m // 2, rank)

    def dp_step() -> float:
        losses = []
        for x, y in data_batch:
            loss = dp(x, y)
            dp.backward(loss)
            dp.step()
            losses.append(float(loss))
        return sum(losses) / len(losses)  # this rank's mean (pp's is over its one replica's micro-batches)

    steps = {"pp": lambda: pp.train_batch(iter(pipe_batch)), "dp": dp_step}
    out: dict[str, Any] = {"pp": [], "dp": [], "pp_batches": [], "loss_first_step": {}}
    for i in range(warmup + rounds):
        for kind in ("pp", "dp") if i % 2 == 0 else ("dp", "pp"):
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            loss = steps[kind]()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            out["loss_first_step"].setdefault(kind, float(loss))
            if i >= warmup:
                out[kind].append((wall, cpu))
                if kind == "pp":
                    out["pp_batches"].append(batch_record(pp))
    dist.barrier()
    out["stage"] = pp.stage_id
    return out


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    if args.pp_micro_batches % 2:
        raise ValueError(f"--pp-micro-batches: an even number is required (dp=2 runs half as many accumulation "
                         f"steps for the same global batch); got {args.pp_micro_batches}.")
    started = time.perf_counter()
    result = spawn(_step_rank, 2, (args.preset, args.seq_len, args.micro_batch, args.pp_micro_batches, args.warmup,
                                   args.rounds), args.timeout)
    log(f"[step {args.preset}] pp=2 vs dp=2, {args.rounds} rounds: {time.perf_counter() - started:.0f} s")
    if isinstance(result, dict):
        return result
    rows: dict[str, Any] = {}
    wall = {k: [max(r[k][i][0] for r in result) for i in range(args.rounds)] for k in ("pp", "dp")}
    for kind in ("pp", "dp"):
        cpu = [max(r[kind][i][1] for r in result) for i in range(args.rounds)]
        rows[kind] = {"step_time_s_median": _median(wall[kind]), "step_time_s_min": round(min(wall[kind]), 4),
                      "step_time_s_max": round(max(wall[kind]), 4), "step_times_s": [round(t, 4) for t in wall[kind]],
                      "cpu_time_s_median": _median(cpu), "loss_first_step": result[0]["loss_first_step"][kind]}
    per_batch = [bubbles(list(records)) for records in zip(*(r["pp_batches"] for r in result))]
    rows["pp"]["bubble_per_stage"] = [_median([b[s] for _, b in per_batch]) for s in range(2)]
    rows["pp"]["bubble_theory"] = round(1 / (args.pp_micro_batches + 1), 4)
    rows["pp/dp"] = {"median": round(rows["pp"]["step_time_s_median"] / rows["dp"]["step_time_s_median"], 3),
                     "paired": paired_ratio(wall["pp"], wall["dp"])}
    return {"setup": {"preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                      "global_batch": args.micro_batch * args.pp_micro_batches,
                      "pp": {"stages": 2, "micro_batches": args.pp_micro_batches, "schedule": "1f1b", "zero": 1},
                      "dp": {"replicas": 2, "gradient_accumulation_steps": args.pp_micro_batches // 2, "zero": 1},
                      "warmup": args.warmup, "rounds": args.rounds, "optimizer": "AdamW (zero_stages.ADAMW)"},
            "results": rows}


# --- the run --------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="bubble,memory,step", help="any of bubble,memory,step")
    parser.add_argument("--quick", action="store_true", help="p 2 and 4, m 4 and 8, 2 reps, the demo GPT, 2 rounds")
    parser.add_argument("--stages", type=_ints, default=[2, 4])
    parser.add_argument("--micro-batches", type=_ints, default=[4, 8, 16])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--forward-ms", type=float, default=10.0,
                        help="a stage's forward per micro-batch (backward 2x; a chunk of 2 does half)")
    parser.add_argument("--reps", type=int, default=5, help="timed batches per bubble configuration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--memory-m", type=int, default=8)
    parser.add_argument("--memory-micro", type=int, default=16)
    parser.add_argument("--memory-width", type=int, default=1024)
    parser.add_argument("--memory-blocks", type=int, default=8)
    parser.add_argument("--preset", default="bench33m", help="a preset of examples/demo/model.py")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--pp-micro-batches", type=int, default=8, help="m of pp=2 (dp=2 accumulates m/2)")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps of pp and of dp, alternating")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.micro_batches, args.reps, args.preset, args.rounds = [4, 8], 2, "demo", 2
    args.schedules = args.schedules.split(",")
    args.out = args.out or str(RESULTS / ("pipeline_parallel_quick.json" if args.quick else "pipeline_parallel.json"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    parts = args.parts.split(",")
    load = LoadSampler()
    report: dict[str, Any] = {"benchmark": "pipeline_parallel", "quick": args.quick,
                              "setup": {"device": "cpu", "backend": "gloo", "threads_per_rank": 1, **environment()}}
    if "bubble" in parts:
        report["bubble"] = {"setup": {"stages": args.stages, "micro_batches": args.micro_batches,
                                      "schedules": args.schedules, "chunks": CHUNKS, "forward_ms_per_stage": args.forward_ms,
                                      "backward_ms_per_stage": 2 * args.forward_ms, "warmup": args.warmup,
                                      "reps": args.reps, "zero": 0},
                            "results": run_bubble(args)}
    if "memory" in parts:
        report["memory"] = run_memory(args)
    if "step" in parts:
        report["step"] = run_step(args)
    report["setup"]["load_average"] = load.summary()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
