"""Memory of loading a DeepSpeed ZeRO-3 checkpoint at another world size, against loading shardwise's own.

DeepSpeed 0.19.8 trains the demo GPT preset `bench33m` (33.4M parameters) one AdamW step at ZeRO-3, world size 2,
and saves; shardwise does the same and saves in its format. Then, in fresh processes, shardwise builds the same
model at ZeRO-3 and world size 1 or 4 and calls `load_checkpoint` on each. A thread on every rank reads
/proc/self/status each millisecond through the call: the growth of anonymous memory (RssAnon: what the load
allocates) and of file-backed memory (RssFile: the pages of DeepSpeed's memory-mapped files the rank touched,
reclaimable page cache shared by the ranks) over their levels before the call. The engine holds its fp32 masters
before the load; the load creates the Adam moments of the rank's shard (8 bytes × parameters / world), so the
anonymous growth beyond those is what loading costs, set against the largest parameter in fp32 (the issue's
bound: no more than ~2 such tensors beyond the rank's shard).

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python benchmarks/deepspeed_checkpoint_load.py

Prints the JSON and writes benchmarks/results/deepspeed_checkpoint_load.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, environment, has_deepspeed, log, spawn, token_batches, write_report  # noqa: E402
from zero_stages import ds_config  # noqa: E402

PRESET, SEQ, MICRO = "bench33m", 128, 1


def _status() -> dict[str, float]:
    """RssAnon and RssFile of this process, in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


class _Peak:
    """The highest RssAnon and RssFile seen, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        self.before = _status()
        self.peak = dict(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, value in _status().items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(0.001)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        for key, value in _status().items():
            self.peak[key] = max(self.peak[key], value)
        return {f"{k}_growth_mib": round(self.peak[k] - self.before[k], 1) for k in self.before}


def _model() -> Any:
    import torch

    from examples.demo.model import GPT, preset

    torch.manual_seed(0)
    return GPT(preset(PRESET, seq_len=SEQ))


def _save(rank: int, library: str, root: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if library == "deepspeed":
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        import shardwise as ds
    model = _model()
    engine, *_ = ds.initialize(model=model, model_parameters=model.param_groups(), config=ds_config(3, MICRO))
    tokens, labels = token_batches(model.cfg.vocab_size, MICRO, SEQ, 1, rank)[0]
    engine.backward(engine(tokens, labels))
    engine.step()
    engine.save_checkpoint(root, tag="step1")
    return {}


def _load(rank: int, root: str) -> dict[str, Any]:
    import torch

    import shardwise

    torch.set_num_threads(1)
    model = _model()
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) * 4 / 2**20
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.param_groups(), config=ds_config(3, MICRO))
    world = torch.distributed.get_world_size()
    peak = _Peak()
    start = time.perf_counter()
    engine.load_checkpoint(root, tag="step1")
    seconds = time.perf_counter() - start
    growth = peak.stop()
    moments = 8 * params / world / 2**20  # the Adam moments of this rank's shard: created by the load
    return {"rank": rank, "load_s": round(seconds, 3), **growth,
            "own_shard_mib": round(12 * params / world / 2**20, 1), "moments_created_mib": round(moments, 1),
            "anon_beyond_own_moments_mib": round(growth["RssAnon_growth_mib"] - moments, 1),
            "largest_param_fp32_mib": round(largest, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,4")
    args = parser.parse_args(argv)
    if not has_deepspeed():
        raise SystemExit("needs the real DeepSpeed: run with .dsvenv/bin/python (see the docstring)")
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for library in ("deepspeed", "shardwise"):
            log(f"saving with {library} at world size 2")
            result = spawn(_save, 2, (library, f"{tmp}/{library}"), timeout=900)
            if isinstance(result, dict):
                raise SystemExit(f"{library} save failed: {result}")
        for world in map(int, args.worlds.split(",")):
            for library in ("deepspeed", "shardwise"):
                log(f"loading {library}'s checkpoint with shardwise at world size {world}")
                ranks = spawn(_load, world, (f"{tmp}/{library}",), timeout=900)
                if isinstance(ranks, dict):
                    raise SystemExit(f"load failed: {ranks}")
                worst = max(ranks, key=lambda r: r["anon_beyond_own_moments_mib"])
                rows[f"{library} checkpoint -> shardwise world {world}"] = {
                    "ranks": ranks,
                    "worst_rank_anon_beyond_own_moments_mib": worst["anon_beyond_own_moments_mib"],
                    "in_largest_params": round(worst["anon_beyond_own_moments_mib"] / worst["largest_param_fp32_mib"], 2),
                    "max_file_backed_growth_mib": max(r["RssFile_growth_mib"] for r in ranks),
                    "median_load_s": sorted(r["load_s"] for r in ranks)[len(ranks) // 2],
                }
    report = {"benchmark": "deepspeed_checkpoint_load", "preset": PRESET, "saved_at_world": 2, "stage": 3,
              "environment": environment(), "rows": rows}
    write_report(report, RESULTS / "deepspeed_checkpoint_load.json")
    return report


if __name__ == "__main__":
    main()
