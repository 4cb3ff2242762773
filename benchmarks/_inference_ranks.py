"""What `inference.py`'s spawned processes run: the generation timings, the memory of a load, the perplexities.

Speed (two processes, one set per model): rank 0 alone holds Hugging Face's model (`from_pretrained`, its default
dynamic cache) and shardwise at tp 1 (`load_pretrained`, built before the process group exists, as a one-process
user runs it), both on `solo_threads` threads; both ranks hold shardwise at tp 2 on half the threads each. Every call is
preceded by a barrier; during a one-process call rank 1 waits in it (its CPU time there is recorded, to show it
leaves the cores alone), so HF, tp 1 and tp 2 alternate call by call in one pair of processes and the machine's
drift hits them alike. Each (library, dtype, batch) is first warmed up, untimed, by a call for 1 and one for 2 new
tokens (the static cache allocated, the kernels chosen).
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from pathlib import Path
from typing import Any

from _harness import rss_mib
from _inference_models import generate_kwargs, perplexity, prompts, stamping_processor

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _hf(folder: str, dtype: str) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, TORCH_DTYPES[dtype])).eval()


def _shardwise(folder: str, dtype: str, tp: int, max_tokens: int, int8: bool = False) -> Any:
    from shardwise.inference import load_pretrained

    extra = {"quant": {"enabled": True}} if int8 else {}
    return load_pretrained(folder, tensor_parallel={"tp_size": tp}, dtype=dtype, max_out_tokens=max_tokens, **extra)


def _call(model: Any, ids: Any, new: int, pad: int) -> dict[str, Any]:
    """One generate call: wall and CPU time, and the times the prefill and each decoding step ended."""
    stamps: list[float] = []
    kwargs = generate_kwargs(ids, new, pad)
    start, cpu = time.perf_counter(), time.process_time()
    out = model.generate(**kwargs, logits_processor=stamping_processor(stamps))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "prefill_s": stamps[0] - start,
            "steps_s": [b - a for a, b in itertools.pairwise(stamps)], "tokens": out[:, ids.shape[1]:].tolist()}


def _tp(library: str) -> int:
    return 1 if library == "hf" else int(library[2])


def _build(library: str, folder: str, dtype: str, max_tokens: int) -> Any:
    """"hf", or shardwise "tp<N>" with "-int8" for int8 weights."""
    if library == "hf":
        return _hf(folder, dtype)
    return _shardwise(folder, dtype, _tp(library), max_tokens, library.endswith("-int8"))


def _load_all(rank: int, spec: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """This rank's models by (library, dtype): one-process ones (rank 0 only) before the process group exists."""
    import torch
    import torch.distributed as dist

    models: dict[tuple[str, str], Any] = {}
    for tp in (1, 2):
        torch.set_num_threads(spec["solo_threads"] // tp)
        for library in (lib for lib in spec["libraries"] if _tp(lib) == tp and (tp == 2 or rank == 0)):
            for dtype in spec["dtypes"]:
                models[library, dtype] = _build(library, spec["folder"], dtype, spec["prompt_tokens"] + spec["new_tokens"])
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return models


def _turn(rank: int, model: Any, ids: Any, new: int, pad: int, solo: bool, out: dict[str, Any]) -> dict[str, Any] | None:
    """One configuration's turn: its TTFT call and its full call on the ranks it runs on; rank 1 waits out a
    one-process turn in a barrier (and notes the CPU it used meanwhile)."""
    import torch.distributed as dist

    dist.barrier()
    if solo and rank != 0:
        start, cpu = time.perf_counter(), time.process_time()
        dist.barrier()
        out["waiting_wall_s"] += time.perf_counter() - start
        out["waiting_cpu_s"] += time.process_time() - cpu
        return None
    first, full = _call(model, ids, 1, pad), _call(model, ids, new, pad)
    if solo:
        dist.barrier()
    return {"ttft_s": first["wall_s"], "ttft_cpu_s": first["cpu_s"], **full}


def speed_rank(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    models = _load_all(rank, spec)
    pad = (next(iter(models.values())).config.pad_token_id or 0) if models else 0  # rank 1 holds none without tp2
    batch_ids = prompts(spec["vocab"], max(spec["batches"]), spec["prompt_tokens"])
    configs = [(lib, dtype, b) for dtype in spec["dtypes"] for b in spec["batches"] for lib in spec["libraries"]]
    out: dict[str, Any] = {"calls": {}, "waiting_cpu_s": 0.0, "waiting_wall_s": 0.0}
    for r in range(spec["rounds"] + 1):  # round 0 warms every configuration up (2 new tokens), untimed
        for library, dtype, batch in configs[r % len(configs):] + configs[:r % len(configs)]:
            torch.set_num_threads(spec["solo_threads"] // _tp(library))
            row = _turn(rank, models.get((library, dtype)), batch_ids[:batch], spec["new_tokens"] if r else 2, pad,
                        _tp(library) == 1, out)
            if r and row is not None:
                if r > 1:
                    row["tokens"] = None  # the tokens of the first timed round are enough to compare libraries
                out["calls"].setdefault(f"{library}/{dtype}/b{batch}", []).append(row)
    return out


def _rss(key: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class RssSampler:
    """The process's resident set every `period` seconds in a thread: what the load holds as it goes."""

    def __init__(self, period: float = 0.01):
        self.start = time.perf_counter()
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.start, _rss()))
            self._stop.wait(period)

    def stop(self, base: float, points: int = 24) -> list[list[float]]:
        """[seconds, MiB over `base`] at most `points` samples, evenly picked, the largest among them."""
        self._stop.set()
        self._thread.join()
        step = max(1, len(self.samples) // points)
        picked = self.samples[::step]
        peak = max(self.samples, key=lambda s: s[1])
        return [[round(t, 3), round(m - base, 1)] for t, m in sorted({*picked, peak})]


def memory_rank(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One load in fresh processes: the RSS before, during and after it, the weight bytes, then one short generate."""
    import torch
    import transformers  # noqa: F401 - counted in the import's RSS

    import shardwise.inference  # noqa: F401
    from shardwise.inference import weight_bytes

    torch.set_num_threads(spec["threads"])
    _load(spec, spec["warm_folder"])  # the same load of a tiny model first: imports, process group, allocators
    gc.collect()
    base = _rss()
    reset = _reset_peak()
    sampler = RssSampler()
    start = time.perf_counter()
    model = _load(spec, spec["folder"])
    load_s = time.perf_counter() - start
    timeline = sampler.stop(base)
    gc.collect()
    row = {"load_s": round(load_s, 3), "rss_mib_after_import": round(base, 1),
           "load_peak_mib": round(_rss("VmHWM") - base, 1) if reset else None,
           "after_load_mib": round(_rss() - base, 1), "after_load_trimmed_mib": round(_trimmed_rss() - base, 1),
           "weight_bytes": weight_bytes(model), "load_rss_timeline": timeline}
    if spec["impl"] != "hf" and spec["tp"] > 1:
        import torch.distributed as dist

        dist.barrier()
    ids = prompts(model.config.vocab_size, 1, 128)
    model.generate(**generate_kwargs(ids, 8, model.config.pad_token_id or 0))
    row["after_generate_trimmed_mib"] = round(_trimmed_rss() - base, 1)
    row["peak_rss_mib"] = round(rss_mib(), 1)
    return row


def _trimmed_rss() -> float:
    """The RSS once glibc has handed its free heap memory back (malloc_trim): what the process still holds, rather
    than what the allocator kept of temporaries that were freed."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return _rss()


def _load(spec: dict[str, Any], folder: str) -> Any:
    if spec["impl"] == "hf":
        return _hf(folder, spec["dtype"])
    return _shardwise(folder, spec["dtype"], spec["tp"], 256, spec["int8"])


def _reset_peak() -> bool:
    """Restart VmHWM from the current RSS (Linux: clear_refs 5), so the next peak is the load's alone."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def quality_rank(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Perplexity of the trained model on the held-out tail, per dtype and quantization, one process."""
    import json

    import torch

    from shardwise.inference import weight_bytes

    torch.set_num_threads(spec["threads"])
    folder = spec["folder"]
    ids = json.loads((Path(folder) / "heldout.json").read_text())
    rows: dict[str, Any] = {}
    for name, dtype, int8 in (("fp32", "fp32", False), ("bf16", "bf16", False), ("int8-bf16", "bf16", True),
                              ("int8-fp32", "fp32", True)):
        engine = _shardwise(folder, dtype, 1, 256, int8)
        rows[name] = {"dtype": dtype, "int8_weights": int8, "weight_bytes": weight_bytes(engine.module),
                      **perplexity(engine, ids, spec["seq_len"], spec["windows"])}
    hf = _hf(folder, "fp32")
    rows["hf-fp32"] = {"dtype": "fp32", "int8_weights": False, "weight_bytes": weight_bytes(hf),
                       **perplexity(hf, ids, spec["seq_len"], spec["windows"])}
    return rows
