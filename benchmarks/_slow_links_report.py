"""What `slow_links.py` computes from its runs: the bytes gloo should put on the wire, the analytical model
of inter-node traffic (to extrapolate to a real model and link), the printed table and the PNG.

[Note: bytes on the wire] With one rank per host, a rank's interface sends what gloo's algorithms send.
shardwise's `Collectives` issues a flat all-gather on gloo as one broadcast per rank and a reduce-scatter
as one reduce per rank (collectives.py), and counts each as one all-gather / reduce-scatter of the whole
flat tensor (N bytes). Gloo's broadcast is a binomial tree: W-1 chunk sends per broadcast, so over the W
broadcasts every rank sends (W-1)/W·N, a ring's amount. Gloo's reduce is a pipelined ring reduce-scatter
of the chunk (M = N/W) in segments of at most 1 MiB, then a gather of the reduced pieces to the root: a
rank sends (numSegments-2) segments in the ring and M/W to each root but itself, which is (W-1)(W+1)/W²·N
= 15/16·N at W=4 while segments are smaller than 1 MiB (a ring reduce-scatter: 3/4·N), and approaches
(1 + 1/W - 1/W²)·N for large chunks. An all-reduce is gloo's ring: 2(W-1)/W·N; an all-to-all (counted
with its input's N bytes) sends (W-1)/W·N, chunk by chunk to each other rank. Ethernet, IP and TCP
headers add little (veth carries 64 KiB GSO packets: ~0.1%), as do ACKs, the barrier and the store.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from _harness import print_columns, pyplot, save_figure
from _netns_ranks import print_shaping

INTRA_NODE_GROUPS = ("node", "hpz")
"""Groups whose ranks share a node (they never cross the inter-node network)."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def gloo_reduce_sends(total: int, world: int, rank: int, element: int = 4, max_segment: int = 2**20) -> tuple[int, int]:
    """(bytes `rank` sends in gloo's ring phase of a reduce of `total` bytes, bytes it sends to a root not itself)."""
    max_segment = element * (max_segment // element)
    segment = _round_up(min(-(-total // (2 * world)), max_segment), element)
    segments = _round_up(max(-(-total // segment), 2 * world), world)
    per_rank = segments // world
    ring = 0
    for i in range(segments - 2):
        offset = (((rank + 1) * per_rank + i) * segment) % (segments * segment)
        ring += max(0, min(segment, total - offset))
    gather = max(0, min(per_rank * segment, total - rank * per_rank * segment))
    return ring, gather


def _tree_sends(world: int, root: int) -> list[tuple[int, int]]:
    """(sender, receiver) of gloo's binomial-tree broadcast from `root`, one chunk each."""
    dim = max(1, math.ceil(math.log2(world)))
    sends = []
    for vrank in range(world):
        mask = (1 << dim) - 1
        for i in range(dim):
            mask ^= 1 << i
            vpeer = vrank ^ (1 << i)
            if vrank & mask == 0 and vpeer < world and not vrank & (1 << i):
                sends.append(((vrank + root) % world, (vpeer + root) % world))
    return sends


def _sends(op: str, nbytes: int, world: int) -> list[tuple[int, int, float]]:
    """(sender, receiver, bytes) of one collective as shardwise issues it on gloo ([Note: bytes on the wire])."""
    if op == "reduce_scatter":  # one reduce per rank, of the rank's chunk, rooted at that rank
        out = []
        for root in range(world):
            for r in range(world):
                ring, gather = gloo_reduce_sends(nbytes // world, world, r)
                out.append((r, (r - 1) % world, ring))
                if r != root:
                    out.append((r, root, gather))
        return out
    if op == "all_reduce":  # ring: every rank sends 2(W-1)/W of it to its neighbour
        return [(r, (r + 1) % world, 2 * (world - 1) / world * nbytes) for r in range(world)]
    if op == "all_to_all":  # gloo's pairwise exchange: chunk d of every rank goes to rank d
        return [(s, d, nbytes / world) for s in range(world) for d in range(world) if s != d]
    if op == "all_gather":  # one broadcast per rank, of the rank's chunk
        return [(s, d, nbytes / world) for root in range(world) for s, d in _tree_sends(world, root)]
    # a broadcast (its root is not recorded: the average over roots) or an op gloo does not have
    return [(s, d, nbytes / world) for root in range(world) for s, d in _tree_sends(world, root)]


def expected_tx_bytes(comm_per_step: dict[str, dict[str, Any]], group_sizes: dict[str, int],
                      host_of: list[int]) -> list[float]:
    """Bytes per step each host should send to other hosts, from rank 0's comm stats (every rank issues the
    same collectives), for groups spanning every rank in rank order ("data"); `host_of[rank]` is its host."""
    world = len(host_of)
    per_host = [0.0] * (max(host_of) + 1)
    for group, ops in comm_per_step.items():
        if group_sizes.get(group, 1) != world or group in INTRA_NODE_GROUPS:
            continue
        for op, stats in ops.items():
            for size, calls in stats["by_size"].items():
                for src, dst, nbytes in _sends(op, int(size), world):
                    if host_of[src] != host_of[dst]:
                        per_host[host_of[src]] += calls * nbytes
    return per_host


MODEL_SCHEMES = ("zero3", "node-local", "qwz", "qgz", "hpz", "zeropp")


def inter_node_bytes(scheme: str, params: float, trainable: float, bytes_per_element: float, micro_steps: int,
                     nodes: int = 4, ranks_per_node: int = 1) -> float:
    """Bytes one node sends to the others per optimizer step, on a ring over nodes x ranks_per_node ranks.

    Every micro-step ZeRO-3 all-gathers the weights in the forward and again in the backward and
    reduce-scatters the trained weights' gradients; a ring moves (W-1)/W of each tensor over each node's
    outgoing link. node-local: only the trained weights cross (frozen ones live on every node).
    qwz: weight gathers in int8 (1 byte); qgz: gradients in 4 bits (0.5 byte); hpz: the backward gathers
    stay inside the node (its secondary partition), which needs the whole model on each node.
    Quantization scales (a few bytes per block) are left out."""
    w = nodes * ranks_per_node
    f = (w - 1) / w
    p, t, b = params, trainable, bytes_per_element
    per_micro = {
        "zero3": 2 * p * b + t * b,
        "node-local": 3 * t * b,
        "qwz": 2 * p * 1 + t * b,
        "qgz": 2 * p * b + t * 0.5,
        "hpz": p * b + t * b,
        "zeropp": p * 1 + t * 0.5,
    }
    if scheme not in per_micro:
        raise ValueError(f"scheme: one of {', '.join(per_micro)}; got {scheme!r}.")
    return micro_steps * f * per_micro[scheme]


def estimate(params: float = 14.8e9, trainable: float = 68.8e6, bytes_per_element: float = 2, micro_steps: int = 8,
             link_gbit: float | list[float] = (10, 25, 32), compute_s: float = 14.9, nodes: int = 4,
             ranks_per_node: int = 1, ratios: dict[str, float] | None = None) -> dict[str, Any]:
    """Per scheme and link: inter-node GB per step, seconds on the wire, and the step time with communication
    fully hidden behind compute (max) or not at all (sum). `ratios[scheme]` scales the modelled bytes (e.g.
    measured / modelled from slow_links.json's `model_ratio_issued`). Defaults: a 14B LLaMA-shaped model
    (48 layers, hidden 5120, MLP 13824, 8 KV heads) with LoRA r 16 on every projection, bf16, 8 micro-steps
    of 1 x 2048 tokens on 4 nodes of one 24 GB GPU, compute ~1.8 s per micro-step (4·P·tokens at ~65 TFLOP/s)."""
    links = [link_gbit] if isinstance(link_gbit, (int, float)) else list(link_gbit)
    out: dict[str, Any] = {"inputs": {"params": params, "trainable": trainable, "bytes_per_element": bytes_per_element,
                                      "micro_steps": micro_steps, "compute_s": compute_s, "nodes": nodes,
                                      "ranks_per_node": ranks_per_node, "ratios": ratios or {}}, "schemes": {}}
    for scheme in MODEL_SCHEMES:
        if scheme in ("hpz", "zeropp") and ranks_per_node == 1:
            note = "hpz keeps a secondary partition per node: with one GPU per node, the whole model per GPU"
        else:
            note = ""
        nbytes = inter_node_bytes(scheme, params, trainable, bytes_per_element, micro_steps, nodes, ranks_per_node)
        nbytes *= (ratios or {}).get(scheme, 1.0)
        row: dict[str, Any] = {"inter_node_gb_per_step": round(nbytes / 1e9, 3), "note": note}
        for gbit in links:
            wire = nbytes * 8 / (gbit * 1e9)
            row[f"{gbit:g}gbit"] = {"wire_s": round(wire, 2), "step_s_overlapped": round(max(compute_s, wire), 2),
                                    "step_s_serial": round(compute_s + wire, 2)}
        out["schemes"][scheme] = row
    return out


def print_estimate(est: dict[str, Any]) -> None:
    """One line per scheme: inter-node GB per step, then per link seconds on the wire and the step time
    between fully overlapped and fully serial communication."""
    print("inputs:", json.dumps(est["inputs"]))
    for scheme, row in est["schemes"].items():
        links = "  ".join(f"{k}: wire {v['wire_s']:.2f} s, step {v['step_s_overlapped']:.1f}-{v['step_s_serial']:.1f} s"
                          for k, v in row.items() if isinstance(v, dict))
        note = f"  ({row['note']})" if row["note"] else ""
        print(f"{scheme:<11} {row['inter_node_gb_per_step']:9.3f} GB/step  {links}{note}")


def model_ratio_issued(row: dict[str, Any], scheme: str, counts: dict[str, int], nodes: int,
                       ranks_per_node: int) -> float | None:
    """(W-1)/W x the bytes rank 0 issued on groups that cross nodes, over the model's bytes for `scheme`
    (fp32, one micro-step): how far the library's traffic is from the model's assumptions."""
    if scheme not in MODEL_SCHEMES or "comm_per_step_rank0" not in row:
        return None
    w = nodes * ranks_per_node
    issued = sum(s["bytes"] for g, ops in row["comm_per_step_rank0"].items()
                 if g not in INTRA_NODE_GROUPS and row["group_sizes"].get(g, 1) > 1 for s in ops.values())
    modelled = inter_node_bytes(scheme, counts["parameters"], counts["trainable"], 4, 1, nodes, ranks_per_node)
    return round((w - 1) / w * issued / modelled, 4) if modelled else None


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if "error" in row:
        if row["error"].startswith("ConfigError"):  # keys this version does not have yet: name them
            keys = sorted(set(re.findall(r"zero_optimization\.(\w+):", row["error"])))
            return "refused: " + ", ".join(keys)
        return "error: " + row["error"].splitlines()[0][:48]
    return f"{row['step_time_s_median']:.3f} s {row['inter_host_tx_mb_per_step']:.2f} MB"


def print_table(report: dict[str, Any]) -> None:
    links = list(report["setup"]["links"])
    header = ["model", "config", "layout", *[f"{link}: step, tx/host" for link in links], "loss gap"]
    lines = [header]
    for model, configs in report["results"].items():
        for name, by_link in configs.items():
            gaps = [r.get("oracle_max_rel_gap") for r in by_link.values() if "oracle_max_rel_gap" in r]
            lines.append([model, name, report["setup"]["configs"][name]["layout"],
                          *[_cell(by_link.get(link)) for link in links], f"{max(gaps):.1e}" if gaps else "-"])
    print_columns(lines)
    print_shaping(report["setup"]["links"])


def plot(report: dict[str, Any], path: Path) -> Path | str:
    """Step time and inter-host MB per step, per configuration (bars per link), one row per model."""
    plt = pyplot()
    if plt is None:
        return "no PNG (matplotlib is not installed)"
    models, links = list(report["results"]), list(report["setup"]["links"])
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.8 * len(models)), squeeze=False)
    width = 0.8 / max(1, len(links))
    for ax_time, ax_bytes, model in zip(axes[:, 0], axes[:, 1], models):
        configs = list(report["results"][model])
        for j, link in enumerate(links):
            rows = [report["results"][model][c].get(link, {}) for c in configs]
            xs = [i + (j - (len(links) - 1) / 2) * width for i in range(len(configs))]
            for ax, key in ((ax_time, "step_time_s_median"), (ax_bytes, "inter_host_tx_mb_per_step")):
                ax.bar(xs, [r.get(key, math.nan) for r in rows], width, label=link)
                for x, r in zip(xs, rows):
                    if "error" in r:
                        ax.text(x, 0, "refused", rotation=90, ha="center", va="bottom", fontsize=7)
        sent = [r["inter_host_tx_mb_per_step"] for c in configs for r in report["results"][model][c].values()
                if r.get("inter_host_tx_mb_per_step")]
        if sent and max(sent) > 30 * min(sent):  # node-local's bytes next to ZeRO-3's read better in log scale
            ax_bytes.set_yscale("log")
        for ax, title in ((ax_time, "median step time (s), slowest rank"), (ax_bytes, "MB sent per host per step")):
            ax.set_xticks(range(len(configs)), configs, rotation=20)
            ax.set_title(f"{model}: {title}")
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize="small")
    return save_figure(plt, fig, path)
