"""Tensor parallelism measured: traffic on the tensor group against Megatron's count, memory per rank at
tp 1, 2, 4, and the step time of tensor against data parallelism. CPU, gloo, spawned ranks, one thread each.

The model is a Hugging Face LLaMA sized like the bench GPT (examples/demo/model.py, `--preset`): the same
width, depth, vocabulary and sequence length, 8 heads (the GPT's 5 do not divide by 2 or 4, and its attention
does not know about split heads), SwiGLU width 8d/3 rounded up to 32 (the GPT's 4d GELU MLP has the same
parameter count), tied embeddings. AutoTP splits it (`"tensor_parallel": {"autotp_size": tp}`): q/k/v and
gate/up column-wise, o/down row-wise, the embedding and LM head over the vocabulary. AdamW and ZeRO-1 with
zero_stages.py's config; a global batch of `--batch` sequences, each data-parallel replica its share.

1. `traffic` and 2. `memory` (fresh processes per tp in 1, 2, 4; world = tp, dp 1): after `--steps` - 1
   steps, one step's collectives on the tensor group from `engine.comm.stats` (the comms logger's counters:
   calls and bytes per op as issued, the all-gather's gathered output) beside Megatron's count for b·s tokens
   of width h, L layers and vocabulary V, fp32: per layer 2 all-reduces forward (o_proj, down_proj) and 2
   backward (the attention and MLP inputs) of b·s·h elements; the vocab-parallel embedding's forward
   all-reduce and the LM head input's backward all-reduce, b·s·h each; the LM head's all-gather of b·s·V
   logits. Beside it the bytes each rank sends in a ring (all-reduce 2(n-1)/n, all-gather (n-1)/n of the
   message). Memory: each rank's peak RSS (`ru_maxrss`, import included; `rss_mib_after_import` shows that
   part), its RSS after initialize, and `engine.memory_breakdown()`'s model states against the formula.
3. `step`: world 2, tp2 against dp2; world 4, tp4, tp2 x dp2 and dp4. All configurations of a world size
   live in one set of processes and alternate step by step (the order rotating, an untimed barrier first),
   so the machine's drift hits them alike; per step the slower rank's wall and CPU time; medians, min, max
   and paired ratios (median over steps of a_i / b_i). The first step's losses must agree (same model, same
   global batch).
4. `dtensor` (world 2, forward + backward, no optimizer): the decoder layers split by shardwise's own
   autograd ops (`shardwise.tensor_parallel.parallelize`, shared-memory and plain gloo collectives) against
   torch's `parallelize_module` (ColwiseParallel / RowwiseParallel, gloo), interleaved as in 3.

    PYTHONPATH=src .venv/bin/python benchmarks/tensor_parallel.py            # ~8 min on 2 idle cores
    PYTHONPATH=src .venv/bin/python benchmarks/tensor_parallel.py --quick    # ~1.5 min, demo sizes, not for quoting
    ... --parts traffic,memory --tp 2,4

Writes benchmarks/results/tensor_parallel.json (`--quick`: tensor_parallel_quick.json).
"""

from __future__ import annotations

import argparse
import gc
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
    rss_mib,
    spawn,
    token_batches,
    write_report,
)

HEADS = 8
STEP_CONFIGS = {2: [("tp2", 2), ("dp2", 1)], 4: [("tp4", 4), ("tp2xdp2", 2), ("dp4", 1)]}
STEP_RATIOS = [("tp2", "dp2"), ("tp4", "dp4"), ("tp2xdp2", "dp4"), ("tp4", "tp2xdp2")]
FP32 = 4


# --- the model --------------------------------------------------------------------------------------------
def llama_shape(preset_name: str, seq_len: int) -> dict[str, int]:
    from examples.demo.model import preset

    cfg = preset(preset_name, seq_len=seq_len)
    return {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "vocab_size": cfg.vocab_size,
            "intermediate_size": -(-8 * cfg.d_model // 3 // 32) * 32, "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS, "max_position_embeddings": seq_len}


def build_llama(shape: dict[str, int]) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=True))


def param_groups(model: Any) -> list[dict[str, Any]]:
    """nanoGPT's groups, as the GPT's: weight decay on matrices only."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2],
                                                              "weight_decay": 0.0}]


def engine_for(shape: dict[str, int], tp: int, micro: int) -> Any:
    from zero_stages import ds_config

    import shardwise

    model = build_llama(shape)
    config = {**ds_config(1, micro), **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {})}
    return shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)[0]


def train_step(engine: Any, batch: Any) -> float:
    """One optimizer step on this replica's share of the global batch; its loss."""
    data = engine.topology.data
    share = batch[data.rank * batch.shape[0] // data.size:(data.rank + 1) * batch.shape[0] // data.size]
    loss = engine(input_ids=share, labels=share).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def tensor_traffic(engine: Any) -> dict[str, Any]:
    return {op: {"calls": s.calls, "bytes": s.bytes, "by_size": {str(k): v.calls for k, v in sorted(s.by_size.items())}}
            for (op, group), s in sorted(engine.comm.stats.ops.items()) if group == "tensor"}


def megatron_formula(shape: dict[str, int], tokens: int) -> dict[str, Any]:
    act = tokens * shape["hidden_size"] * FP32
    terms = {"layers: 2 forward + 2 backward all-reduces each": (4 * shape["num_hidden_layers"], act),
             "vocab-parallel embedding: forward all-reduce": (1, act), "LM head input: backward all-reduce": (1, act)}
    reduce_calls = sum(c for c, _ in terms.values())
    return {"terms": {k: {"calls": c, "bytes": c * b} for k, (c, b) in terms.items()},
            "all_reduce": {"calls": reduce_calls, "bytes": reduce_calls * act, "message_bytes": act},
            "all_gather": {"calls": 1, "bytes": tokens * shape["vocab_size"] * FP32}}


def proc_rss_mib(key: str) -> float | None:
    """`VmRSS` (resident now) or `VmHWM` (its peak since start or the last reset) from /proc, in MiB."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in status.splitlines() if ln.startswith(key + ":")), None)
    return int(line.split()[1]) / 1024 if line else None


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux: clear_refs 5), so a later peak is the training's alone."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _median(values: list[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)


# --- parts 1 and 2: traffic and memory, fresh processes per tp -------------------------------------------------
def _memory_rank(rank: int, tp: int, shape: dict[str, int], seq_len: int, batch: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 - counted in the import's RSS

    import shardwise  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    after_import = rss_mib()
    engine = engine_for(shape, tp, batch)
    torch.set_num_threads(1)
    gc.collect()
    init_peak, after_init, reset = rss_mib(), proc_rss_mib("VmRSS"), reset_peak_rss()
    batches = token_batches(shape["vocab_size"], batch, seq_len, steps, 0)
    times = []
    for i, (x, _) in enumerate(batches):
        if i == steps - 1:
            engine.comm.stats.reset()
        start = time.perf_counter()
        train_step(engine, x)
        times.append(time.perf_counter() - start)
    b = engine.memory_breakdown()
    return {"traffic": tensor_traffic(engine), "step_times_s": times, "rss_mib_after_import": after_import,
            "init_peak_rss_mib": init_peak, "rss_mib_after_init": after_init, "peak_rss_mib": rss_mib(),
            "train_peak_rss_mib": proc_rss_mib("VmHWM") if reset else None,
            "local_parameters": sum(p.numel() for p in engine.module.parameters()),
            "model_state_bytes": {"parameters": b.parameters.total + b.frozen_parameters.total, "gradients": b.gradients.total,
                                  "optimizer_state": b.optimizer_state.total, "total": b.model_states,
                                  "formula": b.expected_model_states}}


def _traffic_row(tp: int, measured: dict[str, Any], formula: dict[str, Any]) -> dict[str, Any]:
    act = formula["all_reduce"]["message_bytes"]
    reduce = measured.get("all_reduce", {"calls": 0, "bytes": 0, "by_size": {}})
    activation_calls = reduce["by_size"].get(str(act), 0)
    gather = measured.get("all_gather", {"calls": 0, "bytes": 0})
    total = reduce["bytes"] + gather["bytes"]
    total_formula = formula["all_reduce"]["bytes"] + formula["all_gather"]["bytes"]
    return {"tp": tp, "measured": measured, "activation_all_reduces": activation_calls,
            "other_all_reduce_bytes": reduce["bytes"] - activation_calls * act,
            "measured_bytes": total, "formula_bytes": total_formula, "measured_over_formula": round(total / total_formula, 4),
            "all_reduce_calls_over_formula": round(activation_calls / formula["all_reduce"]["calls"], 4),
            "ring_bytes_sent_per_rank": round(reduce["bytes"] * 2 * (tp - 1) / tp + gather["bytes"] * (tp - 1) / tp)}


def run_memory(args: argparse.Namespace, shape: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    formula = megatron_formula(shape, args.batch * args.seq_len)
    traffic: dict[str, Any] = {"formula": formula, "results": []}
    memory: dict[str, Any] = {"results": []}
    for tp in args.tp:
        started = time.perf_counter()
        ranks = spawn(_memory_rank, tp, (tp, shape, args.seq_len, args.batch, args.memory_steps), args.timeout)
        log(f"[memory tp={tp}] {time.perf_counter() - started:.0f} s")
        if isinstance(ranks, dict):
            memory["results"].append({"tp": tp, **ranks})
            continue
        if tp > 1:
            traffic["results"].append(_traffic_row(tp, ranks[0]["traffic"], formula))
        states = [r["model_state_bytes"] for r in ranks]
        per_rank = {f"{key}_per_rank": [None if r[key] is None else round(r[key], 1) for r in ranks] for key in
                    ("rss_mib_after_import", "init_peak_rss_mib", "rss_mib_after_init", "train_peak_rss_mib",
                     "peak_rss_mib")}
        memory["results"].append({
            "tp": tp, **per_rank,
            "local_parameters_per_rank": [r["local_parameters"] for r in ranks],
            "model_state_bytes_per_rank": [s["total"] for s in states], "model_state_bytes_rank0": states[0],
            "step_time_s_last": round(max(r["step_times_s"][-1] for r in ranks), 4)})
    _memory_ratios(memory["results"])
    return traffic, memory


def _memory_ratios(rows: list[dict[str, Any]]) -> None:
    """Each tp's model states and RSS growth over the import's (largest rank) against tp 1's."""
    def growth(row: dict[str, Any], key: str) -> float | None:
        peaks = row[f"{key}_per_rank"]
        if None in peaks:
            return None
        return max(p - i for p, i in zip(peaks, row["rss_mib_after_import_per_rank"]))

    base = next((r for r in rows if r.get("tp") == 1 and "error" not in r), None)
    for row in (r for r in rows if "error" not in r):
        for key in ("train_peak_rss_mib", "peak_rss_mib"):
            row[f"{key}_growth_over_import"] = growth(row, key) and round(growth(row, key), 1)
        if base is None:
            continue
        row["model_states_over_tp1"] = round(max(row["model_state_bytes_per_rank"]) /
                                             max(base["model_state_bytes_per_rank"]), 4)
        for key in ("train_peak_rss_mib", "peak_rss_mib"):
            if growth(row, key) is not None and growth(base, key):
                row[f"{key}_growth_over_tp1"] = round(growth(row, key) / growth(base, key), 4)


# --- part 3: tp against dp, interleaved ---------------------------------------------------------------------
def _step_rank(rank: int, configs: list[tuple[str, int]], shape: dict[str, int], seq_len: int, batch: int,
               warmup: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    engines = {name: engine_for(shape, tp, batch // (world // tp)) for name, tp in configs}
    torch.set_num_threads(1)
    batches = token_batches(shape["vocab_size"], batch, seq_len, warmup + steps, 0)
    names = [name for name, _ in configs]
    out: dict[str, Any] = {name: [] for name in names}
    out["loss_first_step"], out["data_rank"] = {}, {n: e.topology.data.rank for n, e in engines.items()}
    for i, (x, _) in enumerate(batches):
        if i == len(batches) - 1:
            for engine in engines.values():
                engine.comm.stats.reset()
        for name in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            loss = train_step(engines[name], x)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            out["loss_first_step"].setdefault(name, loss)
            if i >= warmup:
                out[name].append((wall, cpu))
    dist.barrier()
    out["bytes_last_step"] = {n: {f"{op}/{g}": s.bytes for (op, g), s in e.comm.stats.ops.items()
                                  if e.comm.stats.group_sizes.get(g, 1) > 1} for n, e in engines.items()}
    return out


def _step_world(world: int, args: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    configs = STEP_CONFIGS[world]
    started = time.perf_counter()
    ranks = spawn(_step_rank, world, (configs, shape, args.seq_len, args.batch, args.warmup, args.steps), args.timeout)
    log(f"[step world={world}] {', '.join(n for n, _ in configs)}: {time.perf_counter() - started:.0f} s")
    if isinstance(ranks, dict):
        return ranks
    rows: dict[str, Any] = {}
    wall = {}
    for name, tp in configs:
        wall[name] = [max(r[name][i][0] for r in ranks) for i in range(args.steps)]
        cpu = [max(r[name][i][1] for r in ranks) for i in range(args.steps)]
        losses = {r["data_rank"][name]: r["loss_first_step"][name] for r in ranks}
        rows[name] = {"tp": tp, "dp": world // tp, "micro_batch": args.batch // (world // tp),
                      "step_time_s_median": _median(wall[name]), "step_time_s_min": round(min(wall[name]), 4),
                      "step_time_s_max": round(max(wall[name]), 4), "step_times_s": [round(t, 4) for t in wall[name]],
                      "cpu_time_s_median": _median(cpu), "loss_first_step": round(statistics.mean(losses.values()), 6),
                      "bytes_last_step_rank0": ranks[0]["bytes_last_step"][name]}
    rows["ratios"] = {f"{a}/{b}": {"median": round(rows[a]["step_time_s_median"] / rows[b]["step_time_s_median"], 3),
                                   "paired": paired_ratio(wall[a], wall[b])}
                      for a, b in STEP_RATIOS if a in wall and b in wall}
    return rows


# --- part 4: shardwise's own ops against DTensor ----------------------------------------------------------------
def _dtensor_rank(rank: int, shape: dict[str, int], seq_len: int, batch: int, warmup: int, steps: int
                  ) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from shardwise.distributed import Collectives
    from shardwise.distributed.topology import Group
    from shardwise.tensor_parallel import TensorLink, parallelize
    from shardwise.tensor_parallel.plans import BUILT_IN

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = Group("tensor", dist.group.WORLD, dist.get_world_size(), rank)
    models = {}
    for name, shm in (("shardwise-shm", True), ("shardwise-gloo", False)):
        models[name] = build_llama(shape)
        parallelize(models[name], BUILT_IN["llama"], TensorLink(Collectives(shm=shm), group))
    models["dtensor"] = build_llama(shape)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {**{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in models["dtensor"].model.layers:
        parallelize_module(layer, mesh, plan)
    names = list(models)
    out: dict[str, Any] = {name: [] for name in names}
    out["loss_first_step"] = {}
    for i, (x, _) in enumerate(token_batches(shape["vocab_size"], batch, seq_len, warmup + steps, 0)):
        for name in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            loss = models[name](input_ids=x, labels=x).loss
            loss.backward()
            models[name].zero_grad(set_to_none=True)
            out["loss_first_step"].setdefault(name, float(loss.detach()))
            if i >= warmup:
                out[name].append(time.perf_counter() - start)
    dist.barrier()
    return out


def run_dtensor(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    started = time.perf_counter()
    ranks = spawn(_dtensor_rank, 2, (shape, args.seq_len, args.batch, args.warmup, args.steps), args.timeout)
    log(f"[dtensor] {time.perf_counter() - started:.0f} s")
    if isinstance(ranks, dict):
        return ranks
    wall = {n: [max(r[n][i] for r in ranks) for i in range(args.steps)] for n in ("shardwise-shm", "shardwise-gloo", "dtensor")}
    rows: dict[str, Any] = {n: {"step_time_s_median": _median(w), "step_time_s_min": round(min(w), 4),
                                "step_time_s_max": round(max(w), 4), "loss_first_step": round(ranks[0]["loss_first_step"][n], 6)}
                            for n, w in wall.items()}
    rows["ratios"] = {f"{a}/dtensor paired": paired_ratio(wall[a], wall["dtensor"]) for a in ("shardwise-shm", "shardwise-gloo")}
    return rows


# --- the run ----------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="traffic,memory,step,dtensor", help="any of traffic,memory,step,dtensor")
    parser.add_argument("--quick", action="store_true", help="the demo sizes, 3 timed steps, world 2 only")
    parser.add_argument("--preset", default="bench33m", help="a preset of examples/demo/model.py to size the LLaMA")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over data-parallel ranks")
    parser.add_argument("--tp", type=_ints, default=[1, 2, 4], help="tensor-parallel sizes of traffic and memory")
    parser.add_argument("--worlds", type=_ints, default=[2, 4], help="world sizes of the step comparison")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps per tp in memory (the last one's traffic)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="timed steps of every configuration, interleaved")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.steps, args.worlds, args.memory_steps = "demo", 3, [2], 2
    args.out = args.out or str(RESULTS / ("tensor_parallel_quick.json" if args.quick else "tensor_parallel.json"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    parts = args.parts.split(",")
    shape = llama_shape(args.preset, args.seq_len)
    load = LoadSampler()
    report: dict[str, Any] = {"benchmark": "tensor_parallel", "quick": args.quick,
                              "setup": {"device": "cpu", "backend": "gloo", "threads_per_rank": 1, "preset": args.preset,
                                        "llama": {**shape, "tie_word_embeddings": True}, "seq_len": args.seq_len,
                                        "global_batch": args.batch, "zero": 1, "optimizer": "AdamW (zero_stages.ADAMW)",
                                        "warmup": args.warmup, "steps": args.steps, **environment()}}
    if "traffic" in parts or "memory" in parts:
        report["traffic"], report["memory"] = run_memory(args, shape)
    if "step" in parts:
        report["step"] = {f"world{w}": _step_world(w, args, shape) for w in args.worlds}
    if "dtensor" in parts:
        report["dtensor"] = run_dtensor(args, shape)
    report["setup"]["load_average"] = load.summary()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
