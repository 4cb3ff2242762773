"""int8 weight-only quantization: each linear (and embedding) weight is stored as int8 with one scale per output
channel (per row of an embedding), and dequantized to the compute dtype when the module reads it.

Symmetric, round to nearest: scale = max|row| / 127, so every weight is off by at most scale / 2; a row-parallel
rank holds part of each row and takes the whole row's max from its group, so a split model dequantizes to the
pieces of the weights the whole one would, and decodes as it does at tp 1. The weight
becomes a property of the module's class, so every forward that reads `module.weight` (the tensor-parallel
styles' row-parallel and vocabulary-parallel forwards among them) works unchanged. A weight shared by two modules
(an embedding tied to the LM head) is quantized once and the two keep sharing it. Memory: 1 byte per weight plus
one scale per row, against 2 in bf16.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from ..tensor_parallel import TensorLink, TensorShard
from ..tensor_parallel.styles import linear_kind

logger = logging.getLogger(__name__)

QUANT, SCALE = "weight_int8", "weight_scale"


def quantize_rows(weight: torch.Tensor, out_dim: int = 0,
                  whole_rows: TensorLink | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, scales) of `weight` with one scale per index along `out_dim`. With `whole_rows`, `weight`
    holds part of each row (a row-parallel layer's piece) and the group holds the rest: the scale is the whole
    row's, so a tensor-parallel rank's piece quantizes exactly as that piece of the whole weight would."""
    rows = weight.detach().movedim(out_dim, 0).flatten(1)  # one row per output channel (a view)
    chunks = range(0, rows.shape[0], max(1, CHUNK_ELEMENTS // max(1, rows.shape[1])))
    per = chunks.step
    amax = torch.cat([rows[i:i + per].float().abs().amax(dim=1) for i in chunks])
    if whole_rows is not None:
        amax = whole_rows.all_reduce(amax, torch.distributed.ReduceOp.MAX)
    scale = (amax / 127.0).clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    q = torch.empty(rows.shape, dtype=torch.int8, device=rows.device)
    for i in chunks:  # fp32 temporaries of one chunk at a time, not of the whole weight
        q[i:i + per] = torch.round(rows[i:i + per].float() / scale[i:i + per]).clamp(-127, 127).to(torch.int8)
    shape = [1] * weight.dim()
    shape[out_dim] = -1
    return (q.view(weight.movedim(out_dim, 0).shape).movedim(0, out_dim).contiguous(), scale.view(shape))


CHUNK_ELEMENTS = 1 << 22
"""Rows quantized at a time, in elements: bounds the fp32 temporaries to 16 MiB whatever the weight's size."""


def _out_dim(module: torch.nn.Module) -> int | None:
    if isinstance(module, torch.nn.Embedding):
        return 0
    kind = linear_kind(module)
    return None if kind is None else 1 if kind == "conv1d" else 0


_classes: dict[type, type] = {}


def _int8_class(cls: type) -> type:
    """`cls` with `weight` read from its int8 values and scales, in the dtype the module computes in. A plain
    `nn.Linear` multiplies by the int8 weight directly (torch's int8 weight-only kernel) instead of dequantizing it
    first; a forward the tensor-parallel styles put on the instance reads `weight` as before."""
    if cls not in _classes:
        def weight(self: torch.nn.Module) -> torch.Tensor:
            return getattr(self, QUANT).to(self.compute_dtype) * getattr(self, SCALE)

        body = {"weight": property(weight), "__module__": cls.__module__}
        if cls.forward is torch.nn.Linear.forward:  # a subclass's own forward (other arguments) is kept
            body["forward"] = _int8_linear_forward
        elif cls.forward is torch.nn.Embedding.forward:
            body["forward"] = _int8_embedding_forward
        _classes[cls] = type(f"Int8{cls.__name__}", (cls,), body)
    return _classes[cls]


def _int8_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    q, scale = getattr(self, QUANT), getattr(self, SCALE)
    if x.dtype != scale.dtype or x.dtype == torch.float32 or not hasattr(torch, "_weight_int8pack_mm"):
        # torch's fp32 int8 kernel is slower than dequantizing (40x the prefill time on the bench model)
        return torch.nn.functional.linear(x, self.weight, self.bias)
    flat = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), q, scale.view(-1))
    out = flat.view(*x.shape[:-1], q.shape[0])
    return out + self.bias if self.bias is not None else out


def _int8_embedding_forward(self: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The rows looked up, then scaled: a lookup never dequantizes the whole table."""
    if self.max_norm is not None:
        return torch.nn.functional.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type)
    rows = torch.nn.functional.embedding(ids, getattr(self, QUANT))
    return rows.to(self.compute_dtype) * torch.nn.functional.embedding(ids, getattr(self, SCALE))


def quantize_int8(model: torch.nn.Module, compute_dtype: torch.dtype, skip: tuple[str, ...] = (),
                  shards: Mapping[int, TensorShard] | None = None, link: TensorLink | None = None) -> int:
    """Quantize every linear, Conv1D and embedding weight of `model` in place (not those under a `skip` name);
    the number of weights quantized. `shards`: id of each tensor-parallel piece -> where it sits in the whole
    weight, `link` the group holding the others: a row-split weight's scales are then its whole rows' (every rank
    of the group must call this)."""
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    shards = shards or {}
    count = 0
    for name, module in model.named_modules():
        out_dim = _out_dim(module)
        weight = module._parameters.get("weight") if out_dim is not None else None
        if weight is None or weight.dim() != 2 or any(name == s or name.startswith(f"{s}.") for s in skip):
            continue
        if id(weight) not in done:
            cut_rows = id(weight) in shards and shards[id(weight)].dim != out_dim
            q, scale = quantize_rows(weight, out_dim, link if cut_rows else None)
            done[id(weight)] = (q.to(weight.device), scale.to(compute_dtype).to(weight.device))
            count += 1
        q, scale = done[id(weight)]
        del module._parameters["weight"]
        module.register_buffer(QUANT, q)
        module.register_buffer(SCALE, scale)
        module.compute_dtype = compute_dtype
        module.__class__ = _int8_class(type(module))
    logger.info("int8 weights: %d weights quantized", count)
    return count


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the weights: parameters plus the int8 values and scales (each tensor counted once)."""
    seen, total = set(), 0
    tensors = [p for p in model.parameters()] + [b for n, b in model.named_buffers() if n.endswith((QUANT, SCALE))]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
