"""What `inference.py` computes from its processes' results: per (library, dtype, batch) medians and spread of the
time to first token and the decoding rate, paired ratios against Hugging Face, the memory ratios, the printed table.

A tp 2 call ends when both ranks are done: its wall times (and each decoding step) are the slower rank's.
"""

from __future__ import annotations

import statistics
from typing import Any

from _harness import print_columns


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return {"median": round(statistics.median(values), digits), "p10": round(q[0], digits),
            "p90": round(q[-1], digits), "min": round(min(values), digits), "max": round(max(values), digits),
            "n": len(values)}


def _merge_tp(ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One record per call: rank 0's, unless the call ran on every rank; then the slower rank's times."""
    calls = [r["calls"].get(key) for r in ranks]
    if calls[1] is None:
        return calls[0]
    merged = []
    for parts in zip(*calls):
        row = dict(parts[0])
        for k in ("wall_s", "cpu_s", "prefill_s", "ttft_s", "ttft_cpu_s"):
            row[k] = max(p[k] for p in parts)
        row["steps_s"] = [max(s) for s in zip(*(p["steps_s"] for p in parts))]
        merged.append(row)
    return merged


def _config_row(calls: list[dict[str, Any]], batch: int, new: int) -> dict[str, Any]:
    decode = [batch * len(c["steps_s"]) / sum(c["steps_s"]) for c in calls]
    steps = [s * 1e3 for c in calls for s in c["steps_s"]]
    return {"ttft_s": spread([c["ttft_s"] for c in calls]), "decode_tokens_per_s": spread(decode, 2),
            "decode_step_ms": spread(steps, 3), "prefill_in_full_call_s": spread([c["prefill_s"] for c in calls]),
            "end_to_end_tokens_per_s": spread([batch * new / c["wall_s"] for c in calls], 2),
            "generate_cpu_s_median": round(statistics.median(c["cpu_s"] for c in calls), 4),
            "ttft_cpu_s_median": round(statistics.median(c["ttft_cpu_s"] for c in calls), 4)}


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    same = sum(a == b for ta, tb in zip(tokens, reference) for a, b in zip(ta, tb))
    return {"sequences_equal": sum(ta == tb for ta, tb in zip(tokens, reference)) / len(reference),
            "tokens_equal": round(same / sum(len(t) for t in reference), 4)}


def _paired(a: list[float], b: list[float]) -> float:
    return round(statistics.median(x / y for x, y in zip(a, b)), 3)


def summarize_speed(ranks: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """{dtype: {"b<batch>": {library: row, "ratios": ...}}} plus rank 1's CPU time while it waited."""
    libraries = spec["libraries"]
    pairs = [(a, "hf") for a in libraries if a != "hf"] + [(a, b) for a, b in (("tp2", "tp1"), ("tp1-int8", "tp1"))
                                                           if a in libraries and b in libraries]
    out: dict[str, Any] = {}
    for dtype in spec["dtypes"]:
        for batch in spec["batches"]:
            calls = {lib: _merge_tp(ranks, f"{lib}/{dtype}/b{batch}") for lib in libraries}
            rows: dict[str, Any] = {lib: _config_row(c, batch, spec["new_tokens"]) for lib, c in calls.items()}
            for lib in libraries:
                if lib != "hf" and "hf" in calls:
                    rows[lib]["greedy_tokens_vs_hf"] = _agreement(calls[lib][0]["tokens"], calls["hf"][0]["tokens"])
            rate = {lib: [batch * len(c["steps_s"]) / sum(c["steps_s"]) for c in calls[lib]] for lib in libraries}
            ttft = {lib: [c["ttft_s"] for c in calls[lib]] for lib in libraries}
            rows["ratios"] = {f"{a}/{b}": {"decode_tokens_per_s": _paired(rate[a], rate[b]),
                                           "ttft": _paired(ttft[a], ttft[b])} for a, b in pairs}
            out.setdefault(dtype, {})[f"b{batch}"] = rows
    wait = ranks[1]
    out["rank1_while_waiting"] = {"wall_s": round(wait["waiting_wall_s"], 2), "cpu_s": round(wait["waiting_cpu_s"], 3)}
    return out


def memory_ratios(rows: dict[str, Any]) -> dict[str, Any]:
    """tp 2's largest rank against tp 1 (weights, load peak, RSS after load); int8 against bf16 at each tp."""
    def worst(name: str, key: str) -> float | None:
        row = rows.get(name)
        if not isinstance(row, dict) or "error" in row or None in [r[key] for r in row["per_rank"]]:
            return None
        return max(r[key] for r in row["per_rank"])

    out: dict[str, Any] = {}
    for kind in ("fp32", "bf16", "int8-bf16", "int8-fp32"):
        for key in ("weight_bytes", "load_peak_mib", "after_load_trimmed_mib"):
            a, b = worst(f"tp2/{kind}", key), worst(f"tp1/{kind}", key)
            if a is not None and b:
                out[f"tp2/tp1 {kind} {key}"] = round(a / b, 3)
    for tp in ("tp1", "tp2"):
        a, b = worst(f"{tp}/int8-bf16", "weight_bytes"), worst(f"{tp}/bf16", "weight_bytes")
        if a is not None and b:
            out[f"{tp} int8/bf16 weight_bytes"] = round(a / b, 3)
    # HF maps an fp32 file and reads its pages on first use: its fp32 load peak is ~0, its weights arrive in the
    # first generate. Compared: the bf16 load (HF converts, shardwise too) and the RSS held after a generate.
    for dtype, key in (("bf16", "load_peak_mib"), ("fp32", "after_generate_trimmed_mib"),
                       ("bf16", "after_generate_trimmed_mib")):
        a, b = worst(f"tp1/{dtype}", key), worst(f"hf/{dtype}", key)
        if a is not None and b:
            out[f"tp1/hf {dtype} {key}"] = round(a / b, 3)
    return out


def print_tables(report: dict[str, Any]) -> None:
    for model, part in report.get("speed", {}).items():
        if "error" in part:
            print(f"speed {model}: {part['error']}")
            continue
        lines = [["model", "dtype", "batch", "library", "TTFT ms", "decode tok/s", "(min-max)", "x HF decode",
                  "x HF TTFT", "tokens = HF"]]
        for dtype, by_batch in part["results"].items():
            if dtype not in ("fp32", "bf16"):
                continue
            for batch, rows in by_batch.items():
                for impl in (k for k in rows if k != "ratios"):
                    row, ratio = rows[impl], rows["ratios"].get(f"{impl}/hf", {})
                    rate = row["decode_tokens_per_s"]
                    lines.append([model, dtype, batch[1:], impl, round(row["ttft_s"]["median"] * 1e3, 1), rate["median"],
                                  f"{rate['min']}-{rate['max']}", ratio.get("decode_tokens_per_s", ""),
                                  ratio.get("ttft", ""), row.get("greedy_tokens_vs_hf", {}).get("tokens_equal", "")])
        print_columns(lines)
        print()
    memory = report.get("memory", {}).get("results", {})
    if memory:
        lines = [["load", "weights MiB/rank", "load peak MiB/rank", "held after load (trimmed)", "after generate",
                  "load s"]]
        for name, row in memory.items():
            if "error" in row:
                lines.append([name, row["error"][:60], "", "", "", ""])
                continue
            ranks = row["per_rank"]
            lines.append([name, "/".join(f"{r['weight_bytes'] / 2**20:.1f}" for r in ranks),
                          "/".join(str(r["load_peak_mib"]) for r in ranks),
                          "/".join(str(r["after_load_trimmed_mib"]) for r in ranks),
                          "/".join(str(r["after_generate_trimmed_mib"]) for r in ranks), max(r["load_s"] for r in ranks)])
        print_columns(lines)
        print()
    quality = report.get("quality", {}).get("results", {})
    if quality and "error" not in quality:
        lines = [["weights", "perplexity", "weight MiB"]]
        lines += [[name, row["perplexity"], round(row["weight_bytes"] / 2**20, 3)] for name, row in quality.items()]
        print_columns(lines)
