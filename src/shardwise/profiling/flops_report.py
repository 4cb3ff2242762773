"""The flops profiler's text: a summary, the top modules at each depth, and the module tree."""

from __future__ import annotations

from collections import defaultdict

from .flops import ModelProfile, ModuleProfile
from .table import render_table
from .units import milliseconds, si

RULE = "-" * 30 + " shardwise flops profiler " + "-" * 30


def _rate(flops: float, seconds: float | None) -> str:
    return si(flops / seconds, "FLOPS") if seconds else "n/a"


def summary(profile: ModelProfile, heading: str) -> list[str]:
    p = profile
    lines = [RULE, heading,
             "FLOPs: matrix products, convolutions and attention (2 per multiply-accumulate); MACs = FLOPs / 2",
             "latencies are measured under the profiler (counter and hooks) and overstate an unprofiled step",
             f"params:                                {si(p.params)}",
             f"fwd MACs:                              {si(p.fwd_macs, 'MACs')}",
             f"fwd FLOPs:                             {si(p.fwd_flops)}",
             f"bwd FLOPs:                             {si(p.bwd_flops)}",
             f"fwd + bwd FLOPs:                       {si(p.flops)}",
             f"fwd latency:                           {milliseconds(p.fwd_latency_s)}",
             f"fwd FLOPS = fwd FLOPs / fwd latency:   {_rate(p.fwd_flops, p.fwd_latency_s)}"]
    if p.bwd_latency_s is not None:
        lines += [f"bwd latency:                           {milliseconds(p.bwd_latency_s)}",
                  f"bwd FLOPS = bwd FLOPs / bwd latency:   {_rate(p.bwd_flops, p.bwd_latency_s)}"]
    if p.step_latency_s is not None:
        lines.append(f"step latency:                          {milliseconds(p.step_latency_s)}")
    if p.bwd_latency_s is not None:
        iteration = p.fwd_latency_s + p.bwd_latency_s + (p.step_latency_s or 0.0)
        lines += [f"iter latency (fwd + bwd + step):       {milliseconds(iteration)}",
                  f"FLOPS = fwd + bwd FLOPs / iter latency: {_rate(p.flops, iteration)}"]
    if p.by_op:
        ops = ", ".join(f"{op} {si(n)}" for op, n in sorted(p.by_op.items(), key=lambda kv: -kv[1]))
        lines.append(f"FLOPs by op (fwd + bwd):               {ops}")
    return lines


def top_modules(profile: ModelProfile, k: int, max_depth: int) -> str:
    by_depth: dict[int, list[ModuleProfile]] = defaultdict(list)
    for m in profile.modules.values():
        if m.depth > 0 and (max_depth < 0 or m.depth <= max_depth):
            by_depth[m.depth].append(m)

    def top(mods: list[ModuleProfile], key, fmt) -> str:
        best = sorted(mods, key=key, reverse=True)[:k]
        return ", ".join(f"{m.name} ({fmt(key(m))})" for m in best)

    rows = [[d, top(mods, lambda m: m.params, si), top(mods, lambda m: m.fwd_macs, lambda v: si(v, "MACs")),
             top(mods, lambda m: m.fwd_latency_s, milliseconds)]
            for d, mods in sorted(by_depth.items())]
    return render_table(f"Top {k} module(s) at each depth", ["Depth", "By params", "By fwd MACs", "By fwd latency"],
                        rows, right_from=99)


def module_tree(profile: ModelProfile, max_depth: int, ignore_types: tuple[str, ...] = ()) -> str:
    total = profile.modules[""]
    rows = []
    for m in profile.modules.values():
        if (max_depth >= 0 and m.depth > max_depth) or m.type_name in ignore_types:
            continue
        label = "  " * m.depth + (m.name.rsplit(".", 1)[-1] if m.name else "(root)") + f" ({m.type_name})"
        share = lambda a, b: f"{100 * a / b:.1f}%" if b else "-"  # noqa: E731
        rows.append([label, si(m.params), share(m.params, total.params), si(m.fwd_macs, "MACs"), si(m.fwd_flops),
                     share(m.fwd_flops, total.fwd_flops), si(m.bwd_flops), milliseconds(m.fwd_latency_s),
                     share(m.fwd_latency_s, total.fwd_latency_s), _rate(m.fwd_flops, m.fwd_latency_s)])
    columns = ["Module", "Params", "% params", "fwd MACs", "fwd FLOPs", "% fwd FLOPs", "bwd FLOPs", "fwd latency",
               "% latency", "fwd FLOPS"]
    depth = "all depths" if max_depth < 0 else f"depth <= {max_depth}"
    return render_table(f"Module tree ({depth}); FLOPs and latency include submodules", columns, rows)


def render(profile: ModelProfile, heading: str, module_depth: int = -1, top_k: int = 1, detailed: bool = True,
           ignore_types: tuple[str, ...] = ()) -> str:
    parts = ["\n".join(summary(profile, heading)), top_modules(profile, top_k, module_depth)]
    if detailed:
        parts.append(module_tree(profile, module_depth, ignore_types))
    parts.append("-" * len(RULE))
    return "\n\n".join(parts)
