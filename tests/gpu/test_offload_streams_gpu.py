"""Offload traffic on a CUDA stream of its own ([Note: copy-stream ordering] in offload/copies.py), read off a
profiler trace rather than timed: ZeRO-3 with parameters and optimizer state in pinned host memory, where the
parameter slices fetched ahead of their all-gathers (host to device) run on a stream other than the compute
kernels' and overlap some of those kernels, and the gradients for the host optimizer (device to host) leave on
that stream too. CUDA only: the CPU has no streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.gpu.device import needs_cuda, on_device

pytestmark = needs_cuda

WIDTH, DEPTH, BATCH = 2048, 8, 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(DEPTH)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def _traced_step(trace_path: str) -> None:
    import shardwise
    from torch.profiler import ProfilerActivity, profile

    pinned = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_param": pinned, "offload_optimizer": pinned,
                                    "stage3_param_persistence_threshold": 0}}
    engine, *_ = shardwise.initialize(model=_model(), config=config)
    x = torch.randn(BATCH, WIDTH, device=engine.device, dtype=torch.bfloat16)

    def step() -> None:
        engine.backward(engine(x).float().square().mean())
        engine.step()

    for _ in range(2):  # the first pass records the order the prefetches follow
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)


def _device_events(trace: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "stream" in e.get("args", {})]
    return [e for e in events if e.get("cat") == "kernel"], [e for e in events if e.get("cat") == "gpu_memcpy"]


def _overlaps(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def test_offload_copies_run_on_their_own_stream_beside_compute(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    on_device(_traced_step, str(path))
    kernels, copies = _device_events(json.loads(path.read_text()))
    streams = [k["args"]["stream"] for k in kernels]
    compute = max(set(streams), key=streams.count)  # the stream that ran most kernels
    side = [c for c in copies if c["args"]["stream"] != compute]
    to_device = [c for c in side if "HtoD" in c["name"]]
    to_host = [c for c in side if "DtoH" in c["name"]]
    summary = f"{len(kernels)} kernels on stream {compute}; copies: {sorted({(c['name'], c['args']['stream']) for c in copies})}"
    assert to_device, f"no parameter fetch (host to device) ran off the compute stream: {summary}"
    assert to_host, f"no gradient (device to host) left on the copy stream: {summary}"
    compute_kernels = [k for k in kernels if k["args"]["stream"] == compute]
    overlapped = [c for c in to_device if any(_overlaps(c, k) for k in compute_kernels)]
    assert overlapped, f"no host-to-device fetch overlapped a compute kernel: {summary}"
