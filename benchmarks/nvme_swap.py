"""NVMe swap throughput: `shardwise.offload.nvme.NvmeSwapper` against `dd` on the same path.

For each aio setting, a fresh `NvmeSwapper` allocates a swap file, writes one `--mib` MiB page-aligned
tensor (`aligned_empty`, random bytes) and waits for it, then reads it back into a second aligned
tensor, checks the bytes, and reports GB/s (1e9 bytes per second, as dd prints). The swapper opens
its files with O_DIRECT where the filesystem allows it (the JSON says whether it did), so neither
direction is served by the page cache. `dd` does the same transfer sequentially, one 1 MiB request
at a time:

    dd if=/dev/zero of=PATH/dd.bin bs=1M count=MIB oflag=direct     (write)
    dd if=PATH/dd.bin of=/dev/null bs=1M iflag=direct                (read)

falling back to plain buffered dd (conv=fsync on the write, so the data reaches the disk) where
O_DIRECT is refused, and saying so. Rounds interleave dd and every setting (the order reversed
every other round); the best and the median over rounds are reported, and the ratios swapper / dd
for both (target >= 0.8). A virtual disk's throughput can swing 3x from one transfer to the next
(bursts, neighbours): trust the medians over the bests, and more rounds over fewer.

    .venv/bin/python benchmarks/nvme_swap.py [--path /mnt/nvme/tmp] [--mib 512] [--rounds 3]

Prints the JSON and writes benchmarks/results/nvme_swap.json.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, LoadSampler, environment, log, verdict, write_report

MIB = 2**20
# name -> AioConfig fields (the rest keep their defaults: block_size 1 MiB, queue_depth 8, thread_count 1)
SETTINGS: dict[str, dict[str, int]] = {
    "default (1 MiB blocks, queue_depth 8, thread_count 1)": {},
    "256 KiB blocks": {"block_size": 256 * 1024},
    "4 MiB blocks": {"block_size": 4 * MIB},
    "16 MiB blocks": {"block_size": 16 * MIB},
    "thread_count 2": {"thread_count": 2},
    "queue_depth 1 (one request at a time, like dd)": {"queue_depth": 1},
}


def _dd(args: list[str]) -> tuple[float, str]:
    """Run dd; (GB/s computed from the bytes and seconds it reports, its summary line)."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    line = done.stderr.strip().splitlines()[-1]
    match = re.match(r"(\d+) bytes .* copied, ([\d.]+) s", line)
    if not match:
        raise RuntimeError(f"dd: cannot read its summary {line!r}")
    return int(match.group(1)) / float(match.group(2)) / 1e9, line


def dd_round(path: Path, mib: int) -> dict[str, Any]:
    target = path / "dd.bin"
    out: dict[str, Any] = {}
    try:
        out["write_gb_s"], out["write_line"] = _dd(["if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct"])
        out["write_direct"] = True
    except subprocess.CalledProcessError:
        out["write_gb_s"], out["write_line"] = _dd(["if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fsync"])
        out["write_direct"] = False
    try:
        out["read_gb_s"], out["read_line"] = _dd([f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
        out["read_direct"] = True
    except subprocess.CalledProcessError:
        out["read_gb_s"], out["read_line"] = _dd([f"if={target}", "of=/dev/null", "bs=1M"])
        out["read_direct"] = False  # buffered: the page cache may serve it
    target.unlink(missing_ok=True)
    return out


def swapper_round(path: Path, mib: int, fields: dict[str, int], source: Any, sink: Any) -> dict[str, Any]:
    from shardwise.config.sections import AioConfig
    from shardwise.offload.nvme import NvmeSwapper

    swapper = NvmeSwapper(str(path), "bench", 0, AioConfig(**fields))
    try:
        nbytes = mib * MIB
        swapper.allocate("tensor", nbytes)
        start, cpu = time.perf_counter(), time.process_time()
        swapper.wait(swapper.write("tensor", source))
        write_s, write_cpu = time.perf_counter() - start, time.process_time() - cpu
        sink.zero_()
        start, cpu = time.perf_counter(), time.process_time()
        swapper.wait(swapper.read("tensor", sink))
        read_s, read_cpu = time.perf_counter() - start, time.process_time() - cpu
        if not bool((sink == source).all()):
            raise RuntimeError("NvmeSwapper: the bytes read back differ from those written")
        return {"write_gb_s": nbytes / write_s / 1e9, "read_gb_s": nbytes / read_s / 1e9,
                "write_cpu_s": write_cpu, "read_cpu_s": read_cpu, "o_direct": swapper._direct}
    finally:
        swapper.close()


def _pool(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("write_gb_s", "read_gb_s"):
        values = [r[key] for r in rounds]
        out[f"{key}_best"] = round(max(values), 3)
        out[f"{key}_median"] = round(statistics.median(values), 3)
    for key in ("write_cpu_s", "read_cpu_s"):
        if key in rounds[0]:
            out[f"{key}_median"] = round(statistics.median(r[key] for r in rounds), 4)
    for key in ("o_direct", "write_direct", "read_direct", "write_line", "read_line"):
        if key in rounds[0]:
            out[key] = rounds[0][key]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=None, help="directory to swap in (default: a fresh one under /tmp)")
    parser.add_argument("--mib", type=int, default=512, help="tensor size in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "nvme_swap.json"))
    args = parser.parse_args(argv)

    import torch

    from shardwise.offload.nvme import aligned_empty

    load = LoadSampler()
    base = Path(args.path) if args.path else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="shardwise-nvme-bench-", dir=base))
    source = aligned_empty(args.mib * MIB, torch.uint8)
    source.copy_(torch.randint(0, 256, (args.mib * MIB,), dtype=torch.uint8))
    sink = aligned_empty(args.mib * MIB, torch.uint8)
    dd_runs: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    try:
        for r in range(args.rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
            dd_runs.append(dd_round(path, args.mib))
            log(f"[round {r}] dd: write {dd_runs[-1]['write_gb_s']:.2f} GB/s, read {dd_runs[-1]['read_gb_s']:.2f} GB/s")
            for name in order:
                runs[name].append(swapper_round(path, args.mib, SETTINGS[name], source, sink))
                log(f"[round {r}] {name}: write {runs[name][-1]['write_gb_s']:.2f}, read {runs[name][-1]['read_gb_s']:.2f} GB/s")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    dd = _pool(dd_runs)
    rows = {name: {"aio": SETTINGS[name], **_pool(rs)} for name, rs in runs.items()}
    for row in rows.values():
        for stat in ("best", "median"):
            for io in ("write", "read"):
                value = round(row[f"{io}_gb_s_{stat}"] / dd[f"{io}_gb_s_{stat}"], 3)
                row[f"{io}_over_dd_{stat}"] = verdict(value, 0.8, at_most=False)
    fs = subprocess.run(["df", "-T", str(base)], capture_output=True, text=True, check=False).stdout.strip().splitlines()[-1:]
    report = {"benchmark": "nvme_swap",
              "setup": {"path": str(base), "filesystem": fs[0] if fs else "", "tensor_mib": args.mib,
                        "rounds": args.rounds, **environment(), "load_average": load.summary()},
              "dd": dd, "swapper": rows}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
