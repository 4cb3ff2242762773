"""LLM fine-tuning throughput and memory: LoRA and full fine-tuning of a ~100M LLaMA-shaped model at
world size 2 on CPU, shardwise ZeRO-3 against DeepSpeed 0.19 ZeRO-3 and plain PyTorch DDP.

The model: `transformers.LlamaForCausalLM`, hidden 768, 10 layers, 12 heads (no GQA), MLP 2048,
vocabulary 16,000, untied head: 95.4M parameters. LoRA: `peft`, r 16, alpha 32, no dropout, on every
projection (q, k, v, o, gate, up, down): 2.3M trainable parameters. Random token batches, micro-batch
2 × sequence 256 per rank, the model's own loss (`labels=input_ids`), AdamW (lr 3e-4, betas 0.9/0.95,
weight decay 0.1), no clipping (set explicitly: DeepSpeed's default is 1.0), no accumulation.

| config | what runs |
| --- | --- |
| shardwise-{lora,full} | model built under `shardwise.zero.Init`, LoRA added after, `shardwise.initialize`, ZeRO-3 |
| shardwise-full-offload | the same with `offload_optimizer: {device: cpu}` (on a CPU-only machine: the code path, not a saving) |
| {shardwise,deepspeed}-{lora,full}-lean | ZeRO-3 releasing each module's parameters right after use (`LEAN` below) |
| deepspeed-{lora,full} | the same with `deepspeed.zero.Init` and `deepspeed.initialize` 0.19 (its CPU Adam op), ZeRO-3 |
| ddp-{lora,full} | the whole model on every rank, `DistributedDataParallel`, `torch.optim.AdamW(fused=True)` |

Both ZeRO-3 libraries get the same config (persistence threshold 100,000: their common default, so the
small LoRA matrices and norms stay gathered). Each configuration runs in freshly spawned processes
(one intra-op thread per rank); per step the slower rank's wall time counts, and its CPU time.
Tokens/s = 2 ranks × 2 × 256 tokens / median step time. Peak memory per rank is `ru_maxrss` at the
end; `rss_growth_mib_per_rank` subtracts what importing torch, transformers, peft and the library cost.
With `--exact-rss` every rank first sets glibc's mmap threshold to 64 KiB, so that freed blocks go back
to the OS and the peak tracks peak live bytes rather than the allocator's retained heap.

    .venv/bin/python benchmarks/finetune_llm.py                         # shardwise and DDP
    DS_ACCELERATOR=cpu PYTHONPATH=src:. FINETUNE_BENCH_SITE=.venv/lib/python3.11/site-packages \\
        .dsvenv/bin/python benchmarks/finetune_llm.py                   # + DeepSpeed (transformers/peft from .venv)

Prints the JSON and writes benchmarks/results/finetune_llm.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
if os.environ.get("FINETUNE_BENCH_SITE"):  # transformers/peft from another environment, after this one's packages
    sys.path.append(str(Path(os.environ["FINETUNE_BENCH_SITE"]).resolve()))
from _harness import (ADAMW, RESULTS, LoadSampler, environment, has_deepspeed, log, merge_ranks,  # noqa: E402
                      pool_steps, ratio, rss_mib, spawn, write_report)

WORLD = 2
CONFIGS = ("shardwise-lora", "deepspeed-lora", "ddp-lora", "shardwise-full", "deepspeed-full", "ddp-full",
           "shardwise-full-offload", "shardwise-lora-lean", "deepspeed-lora-lean", "shardwise-full-lean",
           "deepspeed-full-lean")
MODEL = dict(vocab_size=16_000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=512, tie_word_embeddings=False)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
EXTRA = ("tokens_per_step",)
# "-lean": release every module's gathered parameters right after use and prefetch little, the
# memory-first ZeRO-3 setting (the defaults keep what is reused within 1e9 elements: here, everything).
LEAN = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 20_000_000, "stage3_prefetch_bucket_size": 5_000_000}


def ds_config(micro: int, kind: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 100_000, "overlap_comm": True,
                            "stage3_prefetch_bucket_size": 50_000_000, "reduce_bucket_size": 500_000_000}
    if kind.endswith("-offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if kind.endswith("-lean"):
        zero.update(LEAN)
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 1_000_000, "optimizer": {"type": "AdamW", "params": ADAMW}, "zero_optimization": zero}


def _with_lora(model: Any, mode: str) -> Any:
    if mode != "lora":
        return model
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))


def _build(kind: str, micro: int) -> tuple[Any, Any]:
    """(train_step(input_ids), module) for one configuration."""
    import torch
    import torch.distributed as dist
    import transformers

    library, mode = kind.split("-")[0], kind.split("-")[1]
    config = transformers.LlamaConfig(**MODEL)
    torch.manual_seed(0)
    if library == "ddp":
        dist.init_process_group("gloo")
        model = _with_lora(transformers.LlamaForCausalLM(config), mode)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, **{**ADAMW, "betas": tuple(ADAMW["betas"])}, fused=True)

        def ddp_step(ids: Any) -> None:
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return ddp_step, model
    if library == "deepspeed":
        import deepspeed as lib

        lib.init_distributed(dist_backend="gloo")
    else:
        import shardwise as lib

        lib.init_distributed()
    cfg = ds_config(micro, kind)
    with lib.zero.Init(config_dict_or_path=cfg):
        base = transformers.LlamaForCausalLM(config)
    model = _with_lora(base, mode)
    engine, *_ = lib.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                config=cfg)

    def engine_step(ids: Any) -> None:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    return engine_step, model


def _rank_main(rank: int, kind: str, seq_len: int, micro: int, warmup: int, steps: int,
               exact_rss: bool) -> dict[str, Any]:
    if exact_rss:
        # Every allocation over 64 KiB gets its own mapping, returned to the OS when freed, so peak RSS
        # tracks peak live bytes (glibc otherwise raises its mmap threshold after the first large free
        # and keeps freed blocks in the heap).
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    import torch

    torch.set_num_threads(1)
    import peft  # noqa: F401 - every configuration pays the same imports before the baseline
    import transformers  # noqa: F401

    if kind.startswith("deepspeed"):
        import deepspeed  # noqa: F401 - every configuration pays the same imports before the baseline
    elif kind.startswith("shardwise"):
        import shardwise  # noqa: F401 - every configuration pays the same imports before the baseline
    after_import = rss_mib()
    train_step, model = _build(kind, micro)
    torch.set_num_threads(1)  # whatever the library chose at init, one thread per rank here
    g = torch.Generator().manual_seed(1234 + rank)
    batches = [torch.randint(0, MODEL["vocab_size"], (micro, seq_len), generator=g) for _ in range(warmup + steps)]
    times, cpu_times = [], []
    for ids in batches:
        start, cpu_start = time.perf_counter(), time.process_time()
        train_step(ids)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {"step_times_s": times[warmup:], "cpu_times_s": cpu_times[warmup:], "peak_rss_mib": rss_mib(),
            "rss_mib_after_import": after_import, "tokens_per_step": WORLD * micro * seq_len}


def _parameters() -> dict[str, int]:
    import peft
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
        total = sum(p.numel() for p in model.parameters())
        lora = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
        return {"total": total, "lora": sum(p.numel() for p in lora.parameters() if p.requires_grad)}


def _row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = pool_steps(runs, EXTRA)
    if "step_time_s_median" in row:
        tokens = runs[0]["tokens_per_step"]
        row["tokens_per_s_median"] = round(tokens / row["step_time_s_median"], 1)
        row["tokens_per_s_best"] = round(tokens / row["step_time_s_min"], 1)
        row["tokens_per_cpu_s"] = round(tokens / row["cpu_time_s_median"], 1)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every configuration (reversed order every other round)")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--exact-rss", action="store_true", help="mallopt so that peak RSS tracks peak live bytes")
    parser.add_argument("--out", default=str(RESULTS / "finetune_llm.json"))
    args = parser.parse_args(argv)
    kinds = [k for k in args.configs.split(",") if not k.startswith("deepspeed") or has_deepspeed()]
    load = LoadSampler()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for round_index in range(args.rounds):
        for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
            ranks = spawn(_rank_main, WORLD, (kind, args.seq_len, args.micro_batch, args.warmup, args.steps,
                                              args.exact_rss), args.timeout)
            runs[kind].append(ranks if isinstance(ranks, dict) else merge_ranks(ranks, EXTRA))
            log(f"[round {round_index}] {kind}: {runs[kind][-1].get('step_times_s', runs[kind][-1])}")
    rows: dict[str, Any] = {k: _row(v) for k, v in runs.items()}
    for kind in CONFIGS:
        if kind.startswith("deepspeed") and kind in args.configs.split(",") and not has_deepspeed():
            rows[kind] = "not installed"
    rows["ratios"] = {f"{a}_over_{b}_{what}": ratio(rows.get(a), rows.get(b), key)
                      for mode in ("lora", "full")
                      for a, b in ((f"shardwise-{mode}", f"deepspeed-{mode}"), (f"shardwise-{mode}", f"ddp-{mode}"))
                      for what, key in (("step_time", "step_time_s_median"), ("cpu_time", "cpu_time_s_median"),
                                        ("peak_rss", "peak_rss_mib_per_rank"), ("rss_growth", "rss_growth_mib_per_rank"))}
    report = {"setup": {"world_size": WORLD, "device": "cpu", "backend": "gloo", "model": MODEL, "lora": LORA,
                        "parameters": _parameters(), "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                        "warmup_steps": args.warmup, "timed_steps": args.steps, "rounds": args.rounds,
                        "exact_rss": args.exact_rss, "lean": LEAN,
                        "optimizer": {"type": "AdamW", **ADAMW}, **environment()},
              "configs": rows, "load": load.summary()}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
