"""Inference measured on CPU: shardwise's `load_pretrained` engine at tp 1 and tp 2 against Hugging Face's own
`generate`, the memory of a load per rank, and what int8 weights cost in perplexity.

1. `speed`: per model (`tiny`: the fine-tuning example's 0.87M LLaMA; `bench100m`: a ~110M LLaMA-style config, both
   random weights with seed 0, saved sharded), dtype (fp32, bf16) and batch (1, 8): a prompt of 128 random tokens,
   64 new tokens, greedy. Hugging Face: `from_pretrained` + `generate` (its default dynamic cache), one process on
   the machine's 2 threads; shardwise tp 1: the same, through `load_pretrained` (static cache of prompt + new
   positions); shardwise tp 2: two processes, one thread each. Time to first token (TTFT) is the wall time of
   `generate(max_new_tokens=1)`; the decoding rate is batch x (new - 1) over the time from the first token's
   logits to the last's (a logits processor stamps each step) in a separate full call. All three libraries live
   in one pair of processes and alternate call by call (_inference_ranks.py), `--rounds` times, after a warm-up.
2. `memory` (fresh processes per load, the bench100m model): per rank the weight bytes (`weight_bytes`), the peak
   resident set during the load over the RSS after the imports (VmHWM, reset before the load), the RSS kept after
   it, a sampled RSS timeline; tp 1 and tp 2 in fp32, bf16, int8 weights with bf16 and with fp32 activations, and
   Hugging Face's `from_pretrained` in fp32 and bf16 beside them.
3. `quality`: the tiny LLaMA pretrained as make_assets.py --base does, on all but the text's last `--holdout`
   (_inference_models.py); perplexity on windows of that unseen tail in fp32, bf16, int8 (bf16 activations) and
   int8 (fp32 activations), and Hugging Face's fp32 as the reference, with each one's weight bytes.

    .venv/bin/python benchmarks/inference.py            # everything
    .venv/bin/python benchmarks/inference.py --quick    # ~2 min smoke run: small models, 16 new tokens, 1 round
    .venv/bin/python benchmarks/inference.py --parts speed --models tiny --rounds 5
    .venv/bin/python benchmarks/inference.py --parts speed --libraries hf,tp1,tp1-int8 --dtypes bf16   # int8's speed

Writes benchmarks/results/inference.json (`--quick`: inference_quick.json) and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, LoadSampler, environment, log, spawn, write_report
from _inference_models import DTYPES, SHAPES, write_random, write_trained
from _inference_ranks import memory_rank, quality_rank, speed_rank
from _inference_report import memory_ratios, print_tables, summarize_speed

SOLO_THREADS = 2
"""The machine's 2 cores: one process gets both threads, each of tp 2's ranks one."""


def _folder(root: Path, name: str, cache: dict[str, Any]) -> Path:
    """The model `name` written once under `root` (in a spawned process: the parent stays small)."""
    folder = root / name
    if name not in cache:
        folder.mkdir()
        result = spawn(_write_rank, 1, (name, str(folder)), 600)
        if isinstance(result, dict):
            raise RuntimeError(f"writing {name}: {result['error']}")
        cache[name] = result[0]
    return folder


def _write_rank(rank: int, name: str, folder: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(SOLO_THREADS)
    return write_random(name, Path(folder))


def run_speed(args: argparse.Namespace, root: Path, models: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in args.models:
        folder = _folder(root, name, models)
        spec = {"folder": str(folder), "dtypes": args.dtypes, "batches": args.batches, "new_tokens": args.new_tokens,
                "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "solo_threads": SOLO_THREADS,
                "vocab": models[name]["config"]["vocab_size"], "libraries": args.libraries}
        started = time.perf_counter()
        ranks = spawn(speed_rank, 2, (spec,), args.timeout)
        log(f"[speed {name}] {time.perf_counter() - started:.0f} s")
        out[name] = ranks if isinstance(ranks, dict) else {"model": models[name],
                                                           "results": summarize_speed(ranks, spec)}
    return out


MEMORY_LOADS = [("hf/fp32", "hf", 1, "fp32", False), ("hf/bf16", "hf", 1, "bf16", False)] + [
    (f"tp{tp}/{kind}", "shardwise", tp, dtype, int8) for tp in (1, 2)
    for kind, dtype, int8 in (("fp32", "fp32", False), ("bf16", "bf16", False), ("int8-bf16", "bf16", True),
                              ("int8-fp32", "fp32", True))]


def run_memory(args: argparse.Namespace, root: Path, models: dict[str, Any]) -> dict[str, Any]:
    folder, warm = _folder(root, args.memory_model, models), _folder(root, "tiny", models)
    rows: dict[str, Any] = {}
    for name, impl, tp, dtype, int8 in MEMORY_LOADS:
        if args.quick and (dtype, int8) not in (("fp32", False), ("bf16", True)):
            continue
        spec = {"folder": str(folder), "warm_folder": str(warm), "impl": impl, "tp": tp, "dtype": dtype,
                "int8": int8, "threads": SOLO_THREADS // tp}
        ranks = spawn(memory_rank, tp, (spec,), args.timeout)
        rows[name] = ranks if isinstance(ranks, dict) else {"tp": tp, "dtype": dtype, "int8_weights": int8,
                                                            "per_rank": ranks}
        log(f"[memory {name}] " + ("error" if "error" in rows[name] else
                                   f"peak {[r['load_peak_mib'] for r in ranks]} MiB over import"))
    return {"model": args.memory_model, "parameters": models[args.memory_model]["parameters"], "results": rows,
            "ratios": memory_ratios(rows)}


def _trained_rank(rank: int, folder: str, steps: int, holdout: float) -> dict[str, Any]:
    import torch

    torch.set_num_threads(SOLO_THREADS)
    return write_trained(Path(folder), steps, holdout)


def run_quality(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    folder = root / "trained"
    folder.mkdir()
    started = time.perf_counter()
    made = spawn(_trained_rank, 1, (str(folder), args.pretrain_steps, args.holdout), args.timeout)
    log(f"[quality] pretrained in {time.perf_counter() - started:.0f} s")
    if isinstance(made, dict):
        return made
    spec = {"folder": str(folder), "threads": SOLO_THREADS, "seq_len": 128, "windows": args.windows}
    rows = spawn(quality_rank, 1, (spec,), args.timeout)
    if isinstance(rows, dict):
        return {"model": made[0], **rows}
    rows = rows[0]
    ratios = {"int8-bf16/bf16 weight_bytes": round(rows["int8-bf16"]["weight_bytes"] / rows["bf16"]["weight_bytes"], 3),
              "int8-fp32/fp32 weight_bytes": round(rows["int8-fp32"]["weight_bytes"] / rows["fp32"]["weight_bytes"], 3)}
    for name in ("bf16", "int8-bf16", "int8-fp32", "hf-fp32"):
        ratios[f"{name}/fp32 perplexity"] = round(rows[name]["perplexity"] / rows["fp32"]["perplexity"], 4)
    return {"model": {"base": "examples/finetune_llm/tiny_llama", **made[0]}, "results": rows, "ratios": ratios}


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=_list, default=["speed", "memory", "quality"])
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, few tokens, one round")
    parser.add_argument("--models", type=_list, default=["tiny", "bench100m"], help=f"of tiny, {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", type=_list, default=list(DTYPES))
    parser.add_argument("--libraries", type=_list, default=["hf", "tp1", "tp2"],
                        help="speed's: hf, tp1, tp2, and tp1-int8 / tp2-int8 (shardwise with int8 weights)")
    parser.add_argument("--batches", type=lambda t: [int(x) for x in _list(t)], default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per configuration, interleaved")
    parser.add_argument("--memory-model", default="bench100m")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="make_assets.py's default")
    parser.add_argument("--holdout", type=float, default=0.1, help="share of the text's tokens kept unseen")
    parser.add_argument("--windows", type=int, default=400, help="held-out windows of 128 tokens (at most)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.memory_model, args.new_tokens, args.rounds = ["tiny", "small"], "small", 16, 1
        args.pretrain_steps, args.windows = 30, 16
    args.out = args.out or str(RESULTS / ("inference_quick.json" if args.quick else "inference.json"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    load = LoadSampler()
    report: dict[str, Any] = {"benchmark": "inference", "quick": args.quick, "setup": {
        "device": "cpu", "threads": {"hf_and_tp1": SOLO_THREADS, "tp2_per_rank": SOLO_THREADS // 2},
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "batches": args.batches,
        "dtypes": args.dtypes, "libraries": args.libraries, "rounds": args.rounds, "greedy": True, "shardwise_max_out_tokens":
        args.prompt_tokens + args.new_tokens, **environment()}}
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="inference_bench_") as tmp:
        root = Path(tmp)
        if "speed" in args.parts:
            report["speed"] = run_speed(args, root, models)
        if "memory" in args.parts:
            report["memory"] = run_memory(args, root, models)
        if "quality" in args.parts:
            report["quality"] = run_quality(args, root)
    report["setup"]["load_average"] = load.summary()
    write_report(report, args.out)
    print_tables(report)
    return report


if __name__ == "__main__":
    main()
