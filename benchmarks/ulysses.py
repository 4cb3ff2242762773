"""Ulysses sequence parallelism and ALST on CPU: per-rank peak memory and step time of one long sequence, by
sequence-parallel size, with and without ALST's memory tricks.

Each configuration trains a LLaMA with grouped-query attention (8 query heads, 2 key/value heads) on one sequence
of `--seq` tokens, at sequence-parallel size 1 (the whole sequence on one process), 2 and 4 (world = sp, gloo,
one thread per rank). Per rank: the peak of the bytes allocated during one step above what was live before it
(activations, gradients, temporaries; not the standing weights and optimizer state), from torch's profiler with
profile_memory (tensor storage, as CUDA's allocator counts it), and the median wall time of the steps.
What shrinks with sp is everything sized by the local tokens (activations, logits, the MLP's intermediates);
what does not is the weights, their gradients and the optimizer state (ZeRO divides those). "+alst" adds the
tiled MLP (4 tiles), the tiled logits + loss (8 tiles) and gradient checkpointing with its inputs offloaded to
host memory (on CPU that memory is the same memory: the offload is counted, what it saves is device memory).

    .venv/bin/python benchmarks/ulysses.py                    # sp 1, 2, 4, each also +alst, at 8192 tokens
    .venv/bin/python benchmarks/ulysses.py --seq 4096 --sps 1 2 --no-alst

Writes benchmarks/results/ulysses.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, environment, log, print_columns, spawn, write_report

MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=65536, attn_implementation="sdpa")


def _loss(engine: Any, batch: dict[str, Any], link: Any, alst: bool) -> Any:
    import torch

    from shardwise.sequence_parallel import combine_loss, tiled_cross_entropy

    labels = batch.get("shift_labels")
    if labels is None:  # the whole sequence on this rank
        labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    if alst:
        hidden = engine.module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
        loss = tiled_cross_entropy(hidden, engine.module.lm_head, labels, tiles=8)
    else:
        loss = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels,
                      shift_labels=labels).loss
    return combine_loss(loss, labels, link) if link is not None else loss


def _run(rank: int, sp: int, seq: int, steps: int, stage: int, alst: bool) -> dict[str, Any]:
    import torch
    import transformers

    import shardwise
    from shardwise.planner.measure import AllocationMeter
    from shardwise.sequence_parallel import SequenceShardLoader, offload_checkpoints, recorded_link, tile_forward

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    if alst:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        offload_checkpoints(model)
        for layer in model.model.layers:
            tile_forward(layer.mlp, tiles=4)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "sequence_parallel_size": sp, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    link = recorded_link() if sp > 1 else None
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).unsqueeze(0)}
    own = [batch] * (steps + 2)  # warm-up, measured, timed
    batches = iter(SequenceShardLoader(own, link) if link else own)

    def step(measure: AllocationMeter | None = None) -> tuple[float, int]:
        b = next(batches)
        start = time.perf_counter()
        mark = measure.mark() if measure else 0
        engine.backward(_loss(engine, b, link, alst))
        engine.step()
        return time.perf_counter() - start, mark

    step()  # warm-up: the optimizer state exists from here on, as in every later step
    meter = AllocationMeter("cpu").start()
    _, mark = step(meter)
    meter.stop()
    peak = meter.peak_since(mark)
    times = [step()[0] for _ in range(steps)]
    return {"rank": rank, "peak_step_bytes": peak, "step_s": statistics.median(times), "tokens": seq // sp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--sps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--no-alst", dest="alst", action="store_false", help="only the plain runs")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=str(RESULTS / "ulysses.json"))
    opts = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {}
    for sp, alst in [(sp, alst) for sp in opts.sps for alst in ((False, True) if opts.alst else (False,))]:
        name = f"sp{sp}" + ("+alst" if alst else "")
        log(f"{name}: {opts.seq} tokens over {sp} rank(s)")
        ranks = spawn(_run, sp, (sp, opts.seq, opts.steps, opts.stage, alst), opts.timeout)
        if isinstance(ranks, dict):
            results[name] = ranks
            continue
        results[name] = {"world": sp, "tokens_per_rank": opts.seq // sp,
                              "peak_step_mib": max(r["peak_step_bytes"] for r in ranks) / 2**20,
                              "step_s": max(r["step_s"] for r in ranks)}
    base = results.get("sp1", {}).get("peak_step_mib")
    for value in results.values():
        if base and "peak_step_mib" in value:
            value["peak_vs_sp1"] = value["peak_step_mib"] / base
    report = {"benchmark": "ulysses", "environment": environment(),
              "settings": {"seq": opts.seq, "steps": opts.steps, "zero_stage": opts.stage, "model": MODEL},
              "results": results}
    write_report(report, opts.out)
    print_columns([["config", "tokens/rank", "peak step MiB", "vs sp1", "step s"]] + [
        [k, v.get("tokens_per_rank"), f"{v.get('peak_step_mib', 0):.0f}", f"{v.get('peak_vs_sp1', 0):.2f}",
         f"{v.get('step_s', 0):.2f}"] for k, v in results.items()])


if __name__ == "__main__":
    main()
