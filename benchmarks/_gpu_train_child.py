"""One configuration of benchmarks/gpu_train.py in a process of its own ([Note: one process per configuration]
in _gpu_train_runner.py): imports its libraries, waits for the parent's `go` on stdin, then builds the model,
trains warm-up plus timed steps on one batch of random tokens and prints one `RESULT {json}` line (step times,
losses, peak memory, which optimizer ran). Two more modes: `probe` (the device, and its bf16 matmul rate) and
`deepspeed-op-build` (DeepSpeed's CPU Adam op, built ahead so that its compile is not inside a timed config).

    python benchmarks/_gpu_train_child.py '<spec json>'
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_train_model import ADAMW, CLIP, build_llama, library_config, shape_from_json  # noqa: E402

Step = Callable[[Any], float]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _import_library(spec: dict[str, Any]) -> Any:
    """The library this config runs, checked to be the one meant: a DeepSpeed child must get the real DeepSpeed
    at the expected version, not shardwise's compat package of the same name (`make gpu-install` puts that one
    into site-packages; the real one's folder is first on PYTHONPATH)."""
    config = spec["config"]
    if config.startswith("deepspeed"):
        import deepspeed

        if deepspeed.__version__ != spec["deepspeed_version"]:
            raise RuntimeError(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}: expected the real "
                               f"DeepSpeed {spec['deepspeed_version']}; put its site first on PYTHONPATH")
        return deepspeed
    if config == "floor" or config == "probe":
        return None
    import shardwise

    src = Path(__file__).resolve().parent.parent / "src"
    if Path(shardwise.__file__).resolve().parent.parent != src:
        raise RuntimeError(f"shardwise from {shardwise.__file__}: expected this tree's {src}; PYTHONPATH must "
                           "start with it")
    return shardwise


def _optimizer_facts(optimizer: Any) -> dict[str, Any]:
    return {"optimizer": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
            "optimizer_fused": getattr(optimizer, "defaults", {}).get("fused")}


def _floor(spec: dict[str, Any], model: Any, device: Any) -> tuple[Step, dict[str, Any]]:
    """A plain PyTorch loop: fp32 parameters, bf16 autocast, torch's fused AdamW, the same clipping."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                                  weight_decay=ADAMW["weight_decay"], fused=True)

    def step(tokens: Any) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["bf16"]):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, {"library": "torch", "version": torch.__version__, **_optimizer_facts(optimizer)}


def _cpu_adam_op() -> float:
    """Loads DeepSpeed's CPU Adam op (building it if no earlier process did): the seconds it took, kept out of
    `init_seconds` and the steps."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    started = time.perf_counter()
    CPUAdamBuilder().load()
    return round(time.perf_counter() - started, 2)


def _library(spec: dict[str, Any], model: Any, lib: Any) -> tuple[Step, dict[str, Any]]:
    name = spec["config"]
    config = library_config(name, spec["micro"], spec["bf16"], spec["deepspeed_optimizer"])
    facts: dict[str, Any] = {"library": name.split("-")[0], "version": str(lib.__version__), "module": lib.__file__,
                             "config_json": config}
    if name.startswith("deepspeed") and "offload" in name:
        facts["op_load_seconds"] = _cpu_adam_op()
    started = time.perf_counter()
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
    facts["init_seconds"] = round(time.perf_counter() - started, 2)

    def step(tokens: Any) -> float:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    # DeepSpeed wraps its optimizer (ZeRO, BF16_Optimizer) and keeps the one it built as `basic_optimizer`.
    return step, {**facts, **_optimizer_facts(getattr(engine, "basic_optimizer", None) or engine.optimizer)}


def _peaks(device: Any) -> dict[str, Any]:
    import torch

    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.type != "cuda":
        return {"peak_memory_bytes": host, "peak_memory_kind": "host RSS (ru_maxrss): the CPU is the device",
                "peak_host_bytes": host}
    return {"peak_memory_bytes": torch.cuda.max_memory_allocated(device), "peak_memory_kind":
            "torch.cuda.max_memory_allocated", "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "peak_host_bytes": host}


def train(spec: dict[str, Any], lib: Any) -> dict[str, Any]:
    import torch

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # every config starts from the same weights and the same batch
    shape = shape_from_json(spec["shape"])
    started = time.perf_counter()
    model = build_llama(shape, spec["seq"], device, torch.bfloat16 if spec.get("build_bf16") else torch.float32)
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable()
    model_build_seconds = round(time.perf_counter() - started, 2)
    step, facts = _floor(spec, model, device) if lib is None else _library(spec, model, lib)
    tokens = torch.randint(0, shape.vocab, (spec["micro"], spec["seq"]), device=device,
                           generator=torch.Generator(device=device).manual_seed(1))
    times, losses = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        _sync(device)
        started = time.perf_counter()
        losses.append(step(tokens))  # .item() waits for the loss; the sync below waits for the step's tail
        _sync(device)
        times.append(time.perf_counter() - started)
    return {**facts, "config": spec["config"], "shape": shape.name, "parameters": shape.parameters,
            "model_build_seconds": model_build_seconds,
            "activation_checkpointing": bool(model.is_gradient_checkpointing),
            "losses": losses, "warmup_seconds": times[: spec["warmup"]], "step_seconds": times[spec["warmup"]:],
            **_peaks(device)}


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """The device and its sustained matmul rate in the compute dtype: a size^3 product, the median of ten
    event-timed repeats after three warm-ups (on the CPU, wall time)."""
    import torch

    cuda = spec["device"] == "cuda"
    size, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.bfloat16 if spec["bf16"] else torch.float32)
    a, b = (torch.randn(size, size, device=spec["device"], dtype=dtype) for _ in range(2))  # never zeros
    times = []
    for _ in range(13):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - started)
    times = sorted(times[3:])
    device = torch.cuda.get_device_properties(0) if cuda else None
    return {"config": "probe", "device": device.name if device else "cpu", "matmul_size": size,
            "matmul_dtype": str(dtype).removeprefix("torch."), "matmul_tflops": 2 * size**3 / times[5] / 1e12,
            "device_memory_bytes": device.total_memory if device else None,
            "capability": f"{device.major}.{device.minor}" if device else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0], "cpus": os.cpu_count()}


def _cap_memory(cap_bytes: int) -> None:
    """--tiny --largest: a pretend capacity, so that a rung too large for it fails as it would on the device
    (exit code 3 and a message, where the device gives an out-of-memory error). Growth over the RSS after the
    imports counts: the CPU is device and host at once here."""
    import threading

    def rss() -> int:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024

    baseline = rss()

    def watch() -> None:
        while True:
            if rss() - baseline > cap_bytes:
                print(f"pretend capacity exceeded: grew by {(rss() - baseline) / 2**20:.0f} MiB over the "
                      f"{cap_bytes / 2**20:.0f} MiB --tiny --largest allows", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    spec = json.loads(sys.argv[1])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's ask for stacks before it kills a hang
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec["port"]))
    started = time.perf_counter()
    import torch  # noqa: F401 - imported while the previous config runs ([Note: one process per configuration])

    if spec["config"] not in ("probe", "deepspeed-op-build"):
        from transformers import LlamaForCausalLM  # noqa: F401 - the lazy module's real import, here too
    lib = _import_library(spec)
    import_seconds = round(time.perf_counter() - started, 2)
    sys.stdin.readline()  # the parent's `go`: the device is ours now
    if spec.get("memory_cap_bytes"):
        _cap_memory(spec["memory_cap_bytes"])
    if spec["config"] == "probe":
        result = probe(spec)
    elif spec["config"] == "deepspeed-op-build":
        result = {"config": "deepspeed-op-build", "op_build_seconds": _cpu_adam_op()}
    else:
        result = train(spec, lib)
    print("RESULT " + json.dumps({**result, "import_seconds": import_seconds}), flush=True)
    # Out without the interpreter's teardown (NCCL, the allocator's tens of GiB, DeepSpeed's atexit hooks):
    # the driver frees all of it when the process ends, and the next config waits for that end.
    os._exit(0)


if __name__ == "__main__":
    main()
