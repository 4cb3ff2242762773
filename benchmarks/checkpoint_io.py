"""Checkpoint I/O: save and load time, async-save stall, and consolidation memory, against DeepSpeed 0.19.

World size 2 on CPU (gloo, one thread per rank), the demo GPT preset `bench33m` (33.4M parameters)
trained a step with AdamW so the optimizer state exists, then:

1. save and load: `engine.save_checkpoint(dir, tag)` timed on the slower rank (barrier before, and
   after for a synchronous save), `--saves` times, each followed by `--steps-after` training steps;
   then `engine.load_checkpoint(dir, tag)` of the last one. GB/s is the bytes of the tag directory
   (all ranks' files) over the slower rank's time. Configurations: shardwise and DeepSpeed at
   stages 2 and 3. shardwise fsyncs every file before it publishes a tag; DeepSpeed's `torch.save`
   does not, so its save time ends when the bytes reach the page cache. Loads read what was just
   written, from the page cache, in both.
2. the async-save stall: shardwise with `"checkpoint": {"async_save": true}` at stages 2 and 3 (the
   `-async` configurations) against the synchronous saves: the save call itself, then the steps
   that follow (while the write runs in the background) against the steps before the save, and
   after which following step the background write was done. Stall = save call (to the barrier
   after it when synchronous) + what the following steps took beyond the median step before, in
   wall time and in CPU time (process CPU: the writer thread's work included).
3. the disk: `dd` of `--dd-mib` MiB on the same path, with O_DIRECT and buffered with `conv=fsync`
   (what an fsynced save must wait for), and reads with O_DIRECT and from the page cache.
4. consolidation peak RSS: in a fresh process each (under /usr/bin/time -v when it exists, else
   ru_maxrss), shardwise's `shardwise.checkpoint.consolidate.consolidate` and DeepSpeed's
   `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict` on the stage-2 and
   stage-3 checkpoints of the same model, beside a process that only imports the library (the floor
   every figure includes). DeepSpeed writes its default `pytorch_model.bin` (torch.save): its
   safetensors output refuses the demo GPT's tied embedding/head weights, and `max_shard_size=None`
   (one file, as for a model this size anyway) keeps it from needing `huggingface_hub`.

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python benchmarks/checkpoint_io.py [--path DIR]

Prints the JSON and writes benchmarks/results/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import os
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
from _harness import (
    REPO_ROOT,
    RESULTS,
    LoadSampler,
    environment,
    has_deepspeed,
    log,
    ratio,
    rss_mib,
    spawn,
    token_batches,
    write_report,
)
from nvme_swap import _dd
from zero_stages import WORLD, ds_config

CONFIGS = ("shardwise-2", "deepspeed-2", "shardwise-3", "deepspeed-3", "shardwise-2-async", "shardwise-3-async")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _ckpt_main(rank: int, kind: str, preset_name: str, seq_len: int, micro: int, root: str, saves: int,
               steps_before: int, steps_after: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    library, stage = kind.split("-")[:2]
    if library == "deepspeed":
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        import shardwise as ds
    from examples.demo.model import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset(preset_name, seq_len=seq_len))
    config = ds_config(int(stage), micro)
    if kind.endswith("async"):
        config["checkpoint"] = {"async_save": True}
    engine, *_ = ds.initialize(model=model, model_parameters=model.param_groups(), config=config)
    torch.set_num_threads(1)
    batches = iter(token_batches(model.cfg.vocab_size, micro, seq_len, 2 + steps_before + saves * steps_after, rank))

    writer = getattr(engine, "checkpoint_writer", None)

    def writing() -> bool:
        thread = getattr(writer, "_thread", None)
        return thread is not None and thread.is_alive()

    def steps(count: int) -> tuple[list[float], list[float], list[bool]]:
        """Wall and CPU (the whole process: a background writer's work included) per step, and
        whether a background write was still running when the step ended."""
        times, cpu, busy = [], [], []
        for _ in range(count):
            x, y = next(batches)
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.backward(engine(x, y))
            engine.step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            busy.append(writing())
        return times, cpu, busy

    steps(2)  # optimizer state exists; first-step allocations are done
    before, before_cpu, _ = steps(steps_before)
    rss_before_save = rss_mib()
    out: dict[str, Any] = {"steps_before_s": before, "steps_before_cpu_s": before_cpu, "saves": [],
                           "rss_mib_before_save": rss_before_save}
    for i in range(saves):
        tag = f"bench{i}"
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.save_checkpoint(root, tag=tag)
        call_s, call_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        if not kind.endswith("async"):
            dist.barrier()
        save = {"tag": tag, "call_s": call_s, "call_cpu_s": call_cpu_s, "until_barrier_s": time.perf_counter() - start}
        save["steps_after_s"], save["steps_after_cpu_s"], save["writing_after_step"] = steps(steps_after)
        if kind.endswith("async"):
            wait_start = time.perf_counter()
            engine.checkpoint_writer.wait()
            save["wait_after_steps_s"] = time.perf_counter() - wait_start
            save["until_written_s"] = time.perf_counter() - start
        dist.barrier()
        if rank == 0:
            save["bytes"] = _dir_bytes(Path(root) / tag)
        out["saves"].append(save)
    out["peak_rss_mib"] = rss_mib()
    dist.barrier()
    start = time.perf_counter()
    engine.load_checkpoint(root, tag=f"bench{saves - 1}")
    out["load_s"] = time.perf_counter() - start
    dist.barrier()
    out["load_until_barrier_s"] = time.perf_counter() - start
    return out


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    saves = []
    for i, save in enumerate(ranks[0]["saves"]):
        per_rank = [r["saves"][i] for r in ranks]
        s = {k: round(max(p[k] for p in per_rank), 4) for k in ("call_s", "call_cpu_s", "until_barrier_s",
                                                                 "until_written_s", "wait_after_steps_s") if k in save}
        for key in ("steps_after_s", "steps_after_cpu_s"):
            s[key] = [round(max(ts), 4) for ts in zip(*(p[key] for p in per_rank))]
        s["writing_after_step"] = [any(w) for w in zip(*(p["writing_after_step"] for p in per_rank))]
        s["bytes"] = save["bytes"]
        saves.append(s)
    before = [max(ts) for ts in zip(*(r["steps_before_s"] for r in ranks))]
    before_cpu = [max(ts) for ts in zip(*(r["steps_before_cpu_s"] for r in ranks))]
    out: dict[str, Any] = {"saves": saves, "bytes": saves[-1]["bytes"],
                           "steps_before_s": [round(t, 4) for t in before],
                           "steps_before_cpu_s": [round(t, 4) for t in before_cpu],
                           "step_s_before_save_median": round(statistics.median(before), 4),
                           "step_cpu_s_before_save_median": round(statistics.median(before_cpu), 4),
                           "load_s": round(max(r["load_until_barrier_s"] for r in ranks), 4),
                           "rss_mib_before_save_per_rank": [round(r["rss_mib_before_save"], 1) for r in ranks],
                           "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in ranks]}
    out["save_s_min"] = min(s["until_barrier_s"] for s in saves)
    out["save_gb_s"] = round(out["bytes"] / out["save_s_min"] / 1e9, 3)
    out["load_gb_s"] = round(out["bytes"] / out["load_s"] / 1e9, 3)
    # The stall a save causes: the save call plus what the following steps take beyond the steps
    # before it, in wall time (what a run loses, but noisy on a shared machine) and in CPU time (the
    # work added to the training processes, background writer included; on a machine whose cores
    # are all busy it turns into wall time one for one).
    base, base_cpu = out["step_s_before_save_median"], out["step_cpu_s_before_save_median"]
    out["stall_s"] = [round(s["until_barrier_s"] + sum(t - base for t in s["steps_after_s"]), 4) for s in saves]
    out["stall_cpu_s"] = [round(s["call_cpu_s"] + sum(t - base_cpu for t in s["steps_after_cpu_s"]), 4) for s in saves]
    if "until_written_s" in saves[0]:
        out["save_call_s_min"] = min(s["call_s"] for s in saves)
        out["write_done_after_steps"] = [s["writing_after_step"].index(False) + 1 if False in s["writing_after_step"]
                                         else None for s in saves]
    return out


def disk_baseline(path: Path, mib: int) -> dict[str, Any]:
    target = path / "dd.bin"
    out: dict[str, Any] = {}
    for name, args in (("write_direct", ["if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct"]),
                       ("write_buffered_fsync", ["if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fsync"]),
                       ("read_page_cache", [f"if={target}", "of=/dev/null", "bs=1M"]),
                       ("read_direct", [f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])):
        try:
            out[f"{name}_gb_s"] = round(_dd(args)[0], 3)
        except subprocess.CalledProcessError as e:
            out[f"{name}_gb_s"] = f"refused: {e.stderr.strip()[-200:]}"
    target.unlink(missing_ok=True)
    return out


def _measure_process(code: str) -> dict[str, Any]:
    """Run `code` in a fresh python; its peak RSS (MiB) and wall time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    time_bin = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)
    if time_bin:
        start = time.perf_counter()
        done = subprocess.run([time_bin, "-v", sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - start
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
        if done.returncode or not match:
            return {"error": done.stderr[-2000:]}
        return {"peak_rss_mib": round(int(match.group(1)) / 1024, 1), "wall_s": round(wall, 3), "via": "/usr/bin/time -v"}
    wrapped = code + "\nimport resource; print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    match = re.search(r"RSS (\d+)", done.stdout)
    if done.returncode or not match:
        return {"error": done.stderr[-2000:]}
    return {"peak_rss_mib": round(int(match.group(1)) / 1024, 1), "wall_s": round(wall, 3), "via": "ru_maxrss"}


def consolidation(ckpts: dict[str, Path], out_root: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {
        "import only: torch + shardwise": _measure_process("import torch, shardwise.checkpoint.consolidate"),
    }
    if any(k.startswith("deepspeed") for k in ckpts):
        rows["import only: torch + deepspeed zero_to_fp32"] = _measure_process(
            "import torch; from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict")
    for kind, ckpt in ckpts.items():
        out = out_root / f"consolidated-{kind}"
        if kind.startswith("shardwise"):
            code = (f"from shardwise.checkpoint.consolidate import consolidate; "
                    f"consolidate({str(ckpt)!r}, {str(out)!r}, tag='bench0')")
        else:
            code = ("from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
                    f"c({str(ckpt)!r}, {str(out)!r}, max_shard_size=None, tag='bench0')")
        row = _measure_process(code)
        if "error" not in row:
            row["output_bytes"] = _dir_bytes(out)
        rows[kind] = row
        shutil.rmtree(out, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bench33m")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--path", default=None, help="directory for checkpoints and dd (default: fresh under /tmp)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--saves", type=int, default=2, help="saves per configuration (the fastest counts)")
    parser.add_argument("--steps-before", type=int, default=3, help="timed steps before the first save (the baseline)")
    parser.add_argument("--steps-after", type=int, default=2, help="timed steps after each save")
    parser.add_argument("--dd-mib", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(RESULTS / "checkpoint_io.json"))
    args = parser.parse_args(argv)

    load = LoadSampler()
    with_ds = has_deepspeed()
    base = Path(args.path) if args.path else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shardwise-ckpt-bench-", dir=base))
    kinds = [k for k in args.configs.split(",") if with_ds or not k.startswith("deepspeed")]
    rows: dict[str, Any] = {}
    try:
        rows["disk (dd)"] = disk_baseline(work, args.dd_mib)
        log(f"dd: {rows['disk (dd)']}")
        for kind in kinds:
            root = work / kind
            started = time.perf_counter()
            result = spawn(_ckpt_main, WORLD, (kind, args.preset, args.seq_len, args.micro_batch, str(root), args.saves,
                                                args.steps_before, args.steps_after), args.timeout)
            rows[kind] = result if isinstance(result, dict) else summarize(result)
            log(f"{kind}: {rows[kind]} ({time.perf_counter() - started:.0f} s)")
        ckpts = {k: work / k for k in kinds if not k.endswith("async") and "error" not in rows[k]}
        rows["consolidation"] = consolidation(ckpts, work)
        log(f"consolidation: {rows['consolidation']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows["ratios"] = compare(rows)
    report = {"benchmark": "checkpoint_io",
              "setup": {"world_size": WORLD, "preset": args.preset, "seq_len": args.seq_len,
                        "micro_batch": args.micro_batch, "saves": args.saves, "steps_before": args.steps_before,
                        "steps_after": args.steps_after, "path": str(base), **environment(),
                        "load_average": load.summary()},
              "results": rows}
    write_report(report, args.out)
    return report


def compare(rows: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    disk = rows.get("disk (dd)", {})
    for s in (2, 3):
        sw, ds = rows.get(f"shardwise-{s}"), rows.get(f"deepspeed-{s}")
        out[f"shardwise-{s}/deepspeed-{s} save time"] = ratio(sw, ds, "save_s_min")
        out[f"shardwise-{s}/deepspeed-{s} load time"] = ratio(sw, ds, "load_s")
        for key, dd_key in (("save_gb_s", "write_buffered_fsync_gb_s"), ("save_gb_s", "write_direct_gb_s"),
                            ("load_gb_s", "read_page_cache_gb_s"), ("load_gb_s", "read_direct_gb_s")):
            if isinstance(sw, dict) and key in sw and isinstance(disk.get(dd_key), float):
                out[f"shardwise-{s} {key} / dd {dd_key}"] = round(sw[key] / disk[dd_key], 3)
        asy = rows.get(f"shardwise-{s}-async")
        if isinstance(asy, dict) and "stall_s" in asy and isinstance(sw, dict) and "stall_s" in sw:
            for key in ("stall_s", "stall_cpu_s"):
                out[f"shardwise-{s} async/sync {key} (median over saves)"] = round(
                    statistics.median(asy[key]) / statistics.median(sw[key]), 3)
        cons = rows.get("consolidation", {})
        a, b = cons.get(f"shardwise-{s}"), cons.get(f"deepspeed-{s}")
        out[f"consolidation stage {s}: shardwise/deepspeed peak RSS"] = ratio(a, b, "peak_rss_mib")
        out[f"consolidation stage {s}: shardwise/deepspeed wall"] = ratio(a, b, "wall_s")
    return out


if __name__ == "__main__":
    main()
