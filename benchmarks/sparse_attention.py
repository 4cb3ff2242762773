"""Block-sparse attention (shardwise.sparse_attention) against dense causal SDPA: time and peak memory.

    python benchmarks/sparse_attention.py [--seqs 1024 2048 4096 8192 16384] [--repeats 3] [--device cpu]
                                          [--backend auto|flex|blocks|sdpa]

For each sequence length, configurations (dense causal SDPA; Fixed and BigBird unidirectional layouts,
block 64) run in turn, each time in a fresh spawned process, and the whole sweep is repeated
`--repeats` times, interleaved, so drift in machine load falls on every configuration alike. Each run
times `--iters` calls after one warm-up (which also pays flex_attention's compile) and reports the
median; the report gives the median over repeats and the spread (min, max).

Two phases: "train" (forward + backward) and "infer" (forward, no gradient). On CPU, torch 2.13's
flex_attention has no backward, so "train" of the sparse layouts runs the block gather (plain torch ops
over the layout's blocks; it holds gathered K/V and probabilities of the kept blocks, not [S, S] scores);
"infer" runs the compiled flex kernel. Both compute only the layout's blocks. On CUDA both phases run flex.

Memory: CPU: the process's peak RSS minus its RSS before the first call (ru_maxrss, so the whole
process's peak, inputs excluded); CUDA: torch.cuda.max_memory_allocated minus the inputs. No default
path materialises [batch, heads, S, S] scores any more (the SDPA fallback with a dense block mask did);
`--memory-cap-gib` stays for a run that forces that fallback (backend "sdpa"), where 16k tokens cost 1 GiB
of scores per head.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _harness import RESULTS, environment, log, print_columns, rss_mib, spawn, write_report

CONFIGS = ("dense_sdpa", "fixed", "bigbird")


def _sparsity(name: str, heads: int, block: int) -> Any:
    from shardwise.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig

    if name == "fixed":
        return FixedSparsityConfig(heads, block=block, num_local_blocks=4, num_global_blocks=1, attention="unidirectional")
    return BigBirdSparsityConfig(heads, block=block, num_random_blocks=1, num_sliding_window_blocks=3,
                                 num_global_blocks=1, attention="unidirectional")


def _run(rank: int, name: str, phase: str, seq: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from shardwise.sparse_attention import SparseSelfAttention

    torch.manual_seed(0)
    device = torch.device(args["device"])
    shape = (args["batch"], args["heads"], seq, args["head_dim"])
    train = phase == "train"
    q, k, v = (torch.randn(shape, device=device, requires_grad=train) for _ in range(3))
    if name == "dense_sdpa":
        attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        density = 0.5
    else:
        module = SparseSelfAttention(_sparsity(name, args["heads"], args["block"]), max_seq_length=seq,
                                     backend=args["backend"]).to(device)
        attend = lambda: module(q, k, v)  # noqa: E731
        density = float(module.get_layout(seq).float().mean())

    def call() -> None:
        with torch.set_grad_enabled(train):
            out = attend()
            if train:
                out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    before = rss_mib()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    call()  # warm-up (and the flex compile)
    first = time.perf_counter() - start
    times = []
    for _ in range(args["iters"]):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else rss_mib() - before
    return {"median_s": statistics.median(times), "first_call_s": first, "peak_mib": peak, "layout_density": density}


def _skip_reason(name: str, phase: str, seq: int, args: dict[str, Any]) -> str | None:
    # Dense causal SDPA runs torch's flash kernel on CPU (88 MiB at 4k tokens, measured) and the sparse
    # layouts train through the block gather: nothing here holds [S,S] scores unless "sdpa" is forced.
    materialises = args.get("backend") == "sdpa" and name != "dense_sdpa"
    estimate = 4 * args["batch"] * args["heads"] * seq * seq * 4 / 2**30
    if materialises and estimate > args["memory_cap_gib"]:
        return (f"[B,H,S,S] fp32 scores materialised: ~{estimate:.1f} GiB estimated > cap {args['memory_cap_gib']} GiB "
                "(--memory-cap-gib)")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "flex", "blocks", "sdpa"],
                        help="SparseSelfAttention's backend for the sparse layouts")
    parser.add_argument("--phases", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    parser.add_argument("--memory-cap-gib", type=float, default=24.0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=str(RESULTS / "sparse_attention.json"))
    opts = parser.parse_args()
    args = {"batch": opts.batch, "heads": opts.heads, "head_dim": opts.head_dim, "block": opts.block,
            "device": opts.device, "backend": opts.backend, "iters": opts.iters, "memory_cap_gib": opts.memory_cap_gib}
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    for repeat in range(opts.repeats):
        for seq in opts.seqs:
            for phase in opts.phases:
                for name in CONFIGS:
                    label = f"{phase}/{name}/{seq}"
                    reason = _skip_reason(name, phase, seq, args)
                    if reason is not None:
                        skipped[label] = reason
                        continue
                    log(f"repeat {repeat + 1}/{opts.repeats}: {label}")
                    result = spawn(_run, 1, (name, phase, seq, args), opts.timeout)
                    runs.setdefault((phase, name, seq), []).append(result[0] if isinstance(result, list) else result)
    report = {"benchmark": "sparse_attention", "environment": environment(), "settings": {**args, "repeats": opts.repeats},
              "results": _summarise(runs), "skipped": skipped}
    write_report(report, opts.out)
    rows = [["phase", "config", "seq", "median s", "min s", "max s", "peak MiB", "vs dense"]]
    for r in report["results"]:
        rows.append([r["phase"], r["config"], r["seq"], r.get("median_s"), r.get("min_s"), r.get("max_s"),
                     r.get("peak_mib"), r.get("speedup_vs_dense")])
    print_columns(rows)


def _summarise(runs: dict[tuple[str, str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for (phase, name, seq), results in runs.items():
        ok = [r for r in results if "error" not in r]
        entry: dict[str, Any] = {"phase": phase, "config": name, "seq": seq}
        if not ok:
            entry["error"] = results[0].get("error")
        else:
            medians = [r["median_s"] for r in ok]
            entry.update(median_s=round(statistics.median(medians), 5), min_s=round(min(medians), 5),
                         max_s=round(max(medians), 5), peak_mib=round(max(r["peak_mib"] for r in ok), 1),
                         first_call_s=round(statistics.median(r["first_call_s"] for r in ok), 3),
                         layout_density=round(ok[0]["layout_density"], 4))
        out.append(entry)
    dense = {(e["phase"], e["seq"]): e.get("median_s") for e in out if e["config"] == "dense_sdpa"}
    for e in out:
        base = dense.get((e["phase"], e["seq"]))
        if base and e.get("median_s"):
            e["speedup_vs_dense"] = round(base / e["median_s"], 3)
    return out


if __name__ == "__main__":
    main()
