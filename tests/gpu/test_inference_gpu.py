"""`init_inference` at world 1 on the device (CUDA + NCCL in `make test-gpu`, CPU + gloo in CI), each tiny model
loaded on meta from a safetensors folder (tests/inference_models.py, built here; nothing downloaded), against
Hugging Face's own `generate` on the same device in the same dtype:

- fp16 and bf16: greedy tokens and the prompt's logits;
- int8 weights (DeepSpeed's `dtype=torch.int8`: fp16 compute on CUDA, the model's fp32 on the CPU; and `quant` with
  bf16 compute, torch's int8 weight-only matmul): HF's greedy tokens for the same model quantized the same way in
  plain PyTorch (symmetric int8, one scale per output channel, dequantized into the weights), whose int8 values and
  scales the engine's equal exactly, kept on the device;
- CUDA only: `enable_cuda_graph=True` (decoding steps compiled and replayed as CUDA graphs), fp16 and int8: HF's
  eager tokens, with graphs really replayed.

[Note: greedy agreement in half precision] Two correct computations in fp16/bf16 (a static key/value cache against
HF's dynamic one, torch's int8 matmul against a dequantized weight, inductor's fused kernels against eager ones)
round differently, and where two candidates' logits are nearly tied greedy decoding may pick either; after that
the sequences differ legitimately. So each row's tokens must equal HF's up to its first difference, and there HF's
own logits must show a near-tie: HF's token ahead of ours by at most TIE[dtype] of the logits' scale. A wrong
token at any clear margin fails, and so does a row that differs at the first new token unless that is a near-tie.
In fp32 TIE is 1e-5: the tokens must be HF's (as tests/unit/test_inference.py asserts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests import inference_models as im
from tests.gpu.device import CUDA, DEVICE, needs_cuda, on_device

transformers = pytest.importorskip("transformers")

INT8_COMPUTE = torch.float16 if CUDA else torch.float32
"""DeepSpeed's int8 computes in fp16 on a GPU; on the CPU shardwise keeps the model's dtype (inference/build.py)."""
# (name, init_inference keywords, compute dtype, quantized)
MODES = [
    ("fp16", {"dtype": torch.float16}, torch.float16, False),
    ("bf16", {"dtype": torch.bfloat16}, torch.bfloat16, False),
    ("int8", {"dtype": torch.int8}, INT8_COMPUTE, True),
    ("bf16-quant", {"dtype": torch.bfloat16, "quant": {"enabled": True}}, torch.bfloat16, True),
]
TIE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}
LOGITS = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}
"""TIE: how close (relative to the logits' largest magnitude) HF's two best candidates must be where our greedy token
differs from HF's ([Note: greedy agreement in half precision]); LOGITS: the prompt's logits against HF's, same
scale. fp32 only reorders sums. bf16 keeps 8 significant bits: on the CPU the prompt's logits of bf16 with int8
weights (torch's int8 matmul) were measured within 1.9e-2 of HF's (plain bf16: equal), and the widest margin at a
divergence was 7.3e-3. fp16 keeps 11 bits, ~8x finer (2.3e-3 expected where bf16 gives 1.9e-2). A divergence
needs the two candidates' errors to overturn HF's margin, so TIE is about twice the logit error with room; each is
far below what a wrong scale, a dropped bias or a wrong dtype does."""
GRAPH_KINDS = ("llama",)


def _build(kind: str) -> torch.nn.Module:
    """im.build's model with random biases (transformers initializes them to 0, where a bias dropped by a kernel
    path would go unnoticed)."""
    model = im.build(kind)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inference_gpu")
    return {kind: im.save_folder(_build(kind), root / kind) for kind in im.KINDS}


def _quantized_as_shardwise(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The plain-PyTorch int8 round trip of every linear, Conv1D and embedding weight, in place, after the cast to
    the compute dtype: scale = max|output channel| / 127 in fp32, q = round(w / scale) in [-127, 127], and the
    weight becomes q * scale in `dtype` (the scale rounded to `dtype` first, as the engine keeps it). Returns each
    module's (q, scale); a weight tied to another module's is quantized from the same values, so both agree."""
    from transformers.pytorch_utils import Conv1D

    model.to(dtype)
    quantized = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            channel = 0 if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) else \
                1 if isinstance(module, Conv1D) else None  # the output channels' dimension
            if channel is not None:
                w = module.weight.float()
                scale = (w.abs().amax(dim=1 - channel, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
                quantized[name] = (torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.to(dtype))
        for name, module in model.named_modules():  # after: a tied weight's second module saw the original too
            if name in quantized:
                q, scale = quantized[name]
                module.weight.copy_(q.to(dtype) * scale)
    return {name: (q.cpu(), scale.cpu()) for name, (q, scale) in quantized.items()}


def _hf(kind: str, dtype: torch.dtype, quantized: bool) -> dict[str, Any]:
    """Hugging Face's model on DEVICE in `dtype` (quantized as shardwise does when asked): greedy tokens, the raw
    logits of each generated step, the prompt's logits, and the int8 values and scales of each module."""
    model = _build(kind).to(DEVICE)
    int8 = _quantized_as_shardwise(model, dtype) if quantized else {}
    model.to(dtype)
    prompts = {k: v.to(DEVICE) for k, v in im.prompts().items()}
    with torch.no_grad():
        out = model.generate(**prompts, **im.greedy_kwargs(), output_logits=True, return_dict_in_generate=True)
        logits = model(**prompts).logits
    return {"tokens": out.sequences.cpu(), "steps": [s.float().cpu() for s in out.logits],
            "logits": logits.float().cpu(), "int8": int8}


def _engine(folder: Path, **kwargs: Any) -> Any:
    import shardwise

    return shardwise.init_inference(im.empty_model(folder), checkpoint=str(folder), max_out_tokens=64, **kwargs)


def _placement(engine: Any) -> dict[str, Any]:
    from shardwise.inference.quantize import QUANT, SCALE

    module = engine.module
    return {"engine": torch.device(engine.device_).type,
            "params": {(p.device.type, p.dtype) for p in module.parameters()},
            "int8": {(b.device.type, b.dtype) for n, b in module.named_buffers() if n.endswith(QUANT)},
            "compute": {m.compute_dtype for m in module.modules() if hasattr(m, "compute_dtype")},
            "quantized": {n: (getattr(m, QUANT).cpu(), getattr(m, SCALE).cpu()) for n, m in module.named_modules()
                          if hasattr(m, QUANT)}}


def _serve(folders: dict[str, Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, folder in folders.items():
        for name, kwargs, dtype, quantized in MODES:
            try:
                engine = _engine(folder, **kwargs)
                out[kind, name] = {"tokens": engine.generate(**im.prompts(), **im.greedy_kwargs()).cpu(),
                                   "logits": im.engine_logits(engine).float().cpu(), **_placement(engine),
                                   "hf": _hf(kind, dtype, quantized)}
            except Exception as e:  # noqa: BLE001 - reported by the test of that case
                out[kind, name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def served(folders) -> dict[str, Any]:
    return on_device(_serve, folders, timeout=600)


def _case(served: dict[str, Any], key: tuple[str, str]) -> dict[str, Any]:
    assert not isinstance(served[key], str), f"{key}: {served[key]}"
    return served[key]


def assert_greedy_agrees(got: torch.Tensor, hf: dict[str, Any], tie: float, label: str) -> int:
    """[Note: greedy agreement in half precision]; returns how many new tokens agreed in all."""
    ref, prompt = hf["tokens"], im.prompts()["input_ids"].shape[1]
    assert got.shape == ref.shape, f"{label}: shape {tuple(got.shape)} vs HF's {tuple(ref.shape)}"
    assert torch.equal(got[:, :prompt], ref[:, :prompt]), f"{label}: the prompt came back changed"
    agreed = 0
    for row in range(ref.shape[0]):
        differ = (got[row, prompt:] != ref[row, prompt:]).nonzero()
        if not len(differ):
            agreed += ref.shape[1] - prompt
            continue
        step = int(differ[0])
        agreed += step
        logits = hf["steps"][step][row]
        ours, theirs = int(got[row, prompt + step]), int(ref[row, prompt + step])
        margin, scale = (logits[theirs] - logits[ours]).item(), logits.abs().max().item()
        assert margin <= tie * scale, (
            f"{label} row {row}: new token {step} is {ours}, HF's is {theirs}, which HF's logits put ahead by "
            f"{margin:.4g} (scale {scale:.4g}; a near-tie is <= {tie * scale:.4g})\nours {got[row, prompt:].tolist()}\n"
            f"HF's {ref[row, prompt:].tolist()}")
    return agreed


def _assert_close_logits(got: torch.Tensor, ref: torch.Tensor, bound: float, label: str) -> None:
    assert got.shape == ref.shape, label
    error, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert error <= bound * scale, f"{label}: logits off by {error:.4g} (scale {scale:.4g}, bound {bound * scale:.4g})"


@pytest.mark.parametrize("kind", im.KINDS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m[0])
def test_generates_hugging_faces_greedy_tokens_on_the_device(kind, mode, served) -> None:
    name, _, dtype, quantized = mode
    got = _case(served, (kind, name))
    label = f"{kind} {name}"
    assert got["engine"] == DEVICE
    assert {d for d, _ in got["params"]} == {DEVICE}, got["params"]  # norms (and biases) stay parameters
    hf = got["hf"]
    if quantized:  # the int8 values and scales are exactly those of the plain-PyTorch quantization, on the device
        assert got["int8"] == {(DEVICE, torch.int8)} and got["compute"] == {dtype}, (got["int8"], got["compute"])
        assert sorted(got["quantized"]) == sorted(hf["int8"]), label
        for name, (q, scale) in hf["int8"].items():
            assert torch.equal(got["quantized"][name][0], q), f"{label} {name}: int8 values"
            assert torch.equal(got["quantized"][name][1], scale), f"{label} {name}: scales"
    else:
        assert got["int8"] == set() and {t for _, t in got["params"]} == {dtype}, got["params"]
    _assert_close_logits(got["logits"], hf["logits"], LOGITS[dtype], label)
    agreed = assert_greedy_agrees(got["tokens"], hf, TIE[dtype], label)
    if dtype is torch.float32:  # the CPU's int8: no near-tie allowance
        assert agreed == 2 * im.NEW_TOKENS, label


def test_int8_differs_from_the_unquantized_model(served) -> None:
    """The int8 oracle is not the fp model under another name: quantization moves the logits (so the int8 cases
    above really compare quantized models)."""
    for kind in im.KINDS:
        int8, half = _case(served, (kind, "bf16-quant")), _case(served, (kind, "bf16"))
        assert (int8["hf"]["logits"] - half["hf"]["logits"]).abs().max() > 1e-2, kind


# --- CUDA graphs --------------------------------------------------------------------------------------------------
def _graphs(folders: dict[str, Path]) -> dict[str, Any]:
    counts = {"capture_begin": 0, "replay": 0}
    for method in counts:  # what inductor's cudagraph trees call to record a step and to replay one
        def counted(self: Any, *args: Any, _name: str = method, _original: Any = getattr(torch.cuda.CUDAGraph, method),
                    **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.cuda.CUDAGraph, method, counted)
    out: dict[str, Any] = {}
    for kind in GRAPH_KINDS:
        for name, kwargs, dtype, quantized in (MODES[0], MODES[2]):
            try:
                engine = _engine(folders[kind], enable_cuda_graph=True, **kwargs)
                first = engine.generate(**im.prompts(), **im.greedy_kwargs()).cpu()  # compiles, records
                counts.update(capture_begin=0, replay=0)
                second = engine.generate(**im.prompts(), **im.greedy_kwargs()).cpu()
                out[kind, name] = {"first": first, "second": second, **counts, "hf": _hf(kind, dtype, quantized),
                                   "dtype": dtype}
            except Exception as e:  # noqa: BLE001 - reported by the test of that case
                out[kind, name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def graphed(folders) -> dict[str, Any]:
    return on_device(_graphs, {k: folders[k] for k in GRAPH_KINDS}, timeout=600)


@pytest.mark.parametrize("kind", GRAPH_KINDS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_cuda) for n in ("fp16", "int8")])
def test_cuda_graphs_replay_and_generate_hugging_faces_tokens(kind, name, graphed) -> None:
    got = _case(graphed, (kind, name))
    # 19 decoding steps after the prefill, compiled with a static cache: in the second call most of them replay a
    # graph recorded before (a graph is also replayed once right after it is recorded: those are not counted)
    reused = got["replay"] - got["capture_begin"]
    assert reused >= im.NEW_TOKENS // 2, f"{kind} {name}: {got['replay']} replays, {got['capture_begin']} recordings"
    for call in ("first", "second"):
        assert_greedy_agrees(got[call], got["hf"], TIE[got["dtype"]], f"{kind} {name} cuda graph, {call} call")
