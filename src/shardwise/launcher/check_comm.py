"""``shardwise check-comm``: is the network between the ranks working, and how fast is it?

``shardwise check-comm [launcher options] [--sizes 1K,1M,16M] [--iters N] [--ops all_reduce,...] [--json FILE]``
starts this module under the launcher (any launcher option works: ``--hostfile``, ``--num_gpus`` ...); it can
also be run by ``torchrun``/``mpirun`` directly as ``python -m shardwise.launcher.check_comm``.

1. The guides' sanity test: a broadcast from rank 0, a send/recv from rank 0 to rank 1, an all-reduce; every
   rank prints what it got, and a wrong value names the rank and the op.
2. Algorithm and bus bandwidth of all_reduce, all_gather, reduce_scatter and all_to_all per message size, as a
   table on rank 0 (nccl-tests' conventions: size = the largest buffer; bus bandwidth = algorithm bandwidth ×
   2(n-1)/n for all_reduce and (n-1)/n for the others, so it is comparable with the link's speed).

Measures raw ``torch.distributed`` on purpose: the network, not the library's bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    number = text[: len(text) - len(unit)]
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional K/M/G suffix, e.g. 4M.")
    return int(number) * _UNITS[unit]


def build_parser() -> argparse.ArgumentParser:
    # No -h of its own: the rest of the command line goes to the launcher; main() answers --help itself.
    parser = argparse.ArgumentParser(
        prog="shardwise check-comm", add_help=False,
        usage="shardwise check-comm [launcher options] [--sizes 64K,1M] [--iters N] [--ops OPS] [--json FILE]",
        description="Sanity-test the network between the ranks (broadcast, send/recv, all_reduce), then time "
                    "collectives per message size. Any launcher option of `shardwise --help` also works here "
                    "(--num_gpus, --hostfile, --launcher, ...).")
    parser.add_argument("--sizes", default="64K,1M,8M", help="message sizes in bytes (K/M/G suffixes)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size (after 2 warm-up)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"collectives to time, from {', '.join(OPS)}")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON (rank 0)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def sanity(rank: int, world: int) -> list[str]:
    """The guides' checks; returns the problems found (each rank checks what it received)."""
    import torch
    import torch.distributed as dist

    problems: list[str] = []
    got = torch.tensor([float(rank == 0) * 42.0])
    dist.broadcast(got, src=0)
    problems += [] if got.item() == 42.0 else [f"broadcast from rank 0 gave {got.item()}, expected 42.0"]
    line = f"rank {rank}/{world} on {socket.gethostname()}: broadcast got {got.item():g}"
    if world > 1 and rank in (0, 1):
        message = torch.tensor([7.0])
        if rank == 0:
            dist.send(message, dst=1)
        else:
            dist.recv(message, src=0)
            problems += [] if message.item() == 7.0 else [f"recv from rank 0 gave {message.item()}, expected 7.0"]
            line += f", recv from rank 0 got {message.item():g}"
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    problems += [] if total.item() == expected else [f"all_reduce gave {total.item()}, expected {expected:g}"]
    print(f"{line}, all_reduce got {total.item():g} (expected {expected:g})" + (" OK" if not problems else " WRONG"),
          flush=True)
    return [f"rank {rank}: {p}" for p in problems]


def collective(op: str, size: int, world: int) -> Callable[[], None]:
    """A closure running one ``op`` on buffers of ``size`` bytes (float32) in total."""
    import torch
    import torch.distributed as dist

    count = max(world, size // 4 // world * world)
    full, part = torch.ones(count), torch.ones(count // world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out = torch.empty(count)
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: gather(out, part),
        "reduce_scatter": lambda: scatter(part, full),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
    }[op]


def time_op(op: str, size: int, iters: int, world: int) -> float:
    """Seconds per call: the slowest rank's average (a collective is as fast as its slowest member)."""
    import torch
    import torch.distributed as dist

    run = collective(op, size, world)
    for _ in range(2):
        run()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def measure(ops: list[str], sizes: list[int], iters: int, world: int) -> list[dict[str, float | int | str]]:
    rows = []
    for op in ops:
        for size in sizes:
            seconds = time_op(op, size, iters, world)
            algbw = size / seconds / 1e9
            rows.append({"op": op, "bytes": size, "time_us": seconds * 1e6, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * BUS_FACTOR[op](world), "world": world})
    return rows


def table(rows: list[dict[str, float | int | str]]) -> str:
    head = f"{'op':<15}{'size':>10}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['op']:<15}{_human(int(r['bytes'])):>10}{r['time_us']:>12.1f}{r['algbw_GBps']:>14.3f}"
                     f"{r['busbw_GBps']:>14.3f}")
    return "\n".join(lines)


def _human(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)


def worker(argv: list[str]) -> int:
    """Run on every rank (under a launcher)."""
    import torch
    import torch.distributed as dist

    from shardwise.distributed.init import init_distributed

    args = build_parser().parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise SystemExit(f"--ops: unknown {unknown}; choose from {', '.join(OPS)}.")
    torch.set_num_threads(1)
    init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = sanity(rank, world)
    failed = torch.tensor([float(len(problems))])
    dist.all_reduce(failed)
    if failed.item():
        print("\n".join(problems), file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 1
    rows = measure(ops, [parse_size(s) for s in args.sizes.split(",")], args.iters, world)
    if rank == 0:
        print(f"\ncheck-comm: {world} ranks, backend {dist.get_backend()}\n{table(rows)}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    """``shardwise check-comm``: its own options are read here, the rest are launcher options."""
    if "-h" in argv or "--help" in argv:  # check-comm takes no script, so any --help is a request for ours
        build_parser().print_help()
        return 0
    own, launcher_options = build_parser().parse_known_args(argv)
    forwarded = [f"--sizes={own.sizes}", f"--iters={own.iters}", f"--ops={own.ops}"]
    forwarded += [f"--json={os.path.abspath(own.json)}"] if own.json else []
    from shardwise.launcher.cli import run_launch

    return run_launch([*launcher_options, "--no_local_rank", "--module", __name__, *forwarded], "shardwise")


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
