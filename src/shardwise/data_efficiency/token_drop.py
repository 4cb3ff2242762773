"""One random-LTD layer: in training it runs on a random, sorted subset of each sequence's tokens, and the
tokens it did not see pass through unchanged.

[Note: random-LTD without a wrapper module]
DeepSpeed replaces each chosen layer by a `RandomLayerTokenDrop` module holding the layer, which renames every
parameter (`h.3.attn...` becomes `h.3.random_ltd_layer.attn...`); its engine then strips the extra name level
when it saves. Here the layer object stays where it is and only its instance `forward` is replaced (the way
accelerate attaches its hooks), so parameter names, state-dict keys and the module tree are the ones of the
model without random-LTD: a checkpoint moves between runs with and without it, and ZeRO-3's per-module hooks,
which `nn.Module.__call__` runs around `forward`, keep gathering and releasing the layer's parameters.
Everything outside the layer (hooks, Hugging Face's output recorders, the next layer) sees full-length tensors.

[Note: random-LTD randomness]
The kept positions are drawn from a private `torch.Generator` seeded from (data_efficiency.seed, optimizer step,
micro-step within the accumulation window, layer index, data-parallel rank), never from the global RNG. So a
resumed run draws the same tokens knowing only the step; tensor-parallel ranks of one replica (same data rank)
agree; the model's dropout stream is the same as without random-LTD; and an activation-checkpointing recompute
in backward (which happens before the engine's next step) draws the same tokens as its forward. The price: two
forwards within one micro-step (a chosen and a rejected batch) see the same positions of a layer.

What a layer receives (transformers 5: GPT-2's block gets hidden states, cache and a mask by position; LLaMA's,
Qwen's, Mistral's and BERT's layers by keyword) is bound to the layer's signature and handled by name:
the mask (a 4-D [batch or 1, heads or 1, queries, keys] mask: rows and columns gathered; a 2-D padding mask:
columns), `position_ids`, `position_embeddings` (LLaMA's cos/sin), a cache that holds nothing for this layer yet
(Hugging Face passes one in training by default; it then records the kept tokens' keys only, and a later
training forward with that cache is refused). Any other tensor
argument, a cache with past tokens, cross-attention, or an output other than a tensor or a tuple whose other
items are None is refused at that forward: a silently wrong subset is worse than an error.
"""

from __future__ import annotations

import hashlib
import inspect
import struct
from typing import Any, Callable, Protocol

import torch

_PASS_THROUGH = (type(None), bool, int, float, str)
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")


class StepSource(Protocol):
    """What a layer needs from the scheduler: the kept count and the coordinates of the current micro-step."""

    def get_current_seq(self) -> int: ...

    def draw_key(self) -> tuple[int, int, int, int]: ...


class TokenDropLayer:
    """Attaches random-LTD to `layer` (its index `layer_index` in the model's layer list) until `detach()`."""

    def __init__(self, layer: torch.nn.Module, layer_index: int, source: StepSource, mask_name: str | None,
                 seq_first: bool):
        self.layer, self.layer_index, self.source, self.seq_first = layer, layer_index, source, seq_first
        self.original: Callable[..., Any] = layer.forward
        self.signature = inspect.signature(self.original)
        params = self.signature.parameters
        self.hidden_name = next(iter(params))
        self.var_kwargs = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        self.mask_name = mask_name or "attention_mask"
        if mask_name is not None and mask_name not in params and self.var_kwargs is None:
            raise ValueError(f"random_ltd.model_mask_name: must name an argument of {type(layer).__name__}.forward "
                             f"({', '.join(params)}); got {mask_name!r}. Name the attention-mask argument or drop "
                             "the key.")
        layer.forward = self.forward  # [Note: random-LTD without a wrapper module]

    def detach(self) -> None:
        if self.layer.__dict__.get("forward") == self.forward:
            del self.layer.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.layer.training:
            return self.original(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        hidden = bound.arguments[self.hidden_name]
        batch, seq = (hidden.shape[1], hidden.shape[0]) if self.seq_first else (hidden.shape[0], hidden.shape[1])
        kept = self.source.get_current_seq()
        if kept >= seq:
            return self.original(*args, **kwargs)
        index = self.draw(batch, seq, kept, hidden.device)
        self._substitute(bound, index, seq)
        bound.arguments[self.hidden_name] = _gather_tokens(hidden, index, self.seq_first)
        output = self.original(*bound.args, **bound.kwargs)
        return self._scatter_output(output, hidden, index)

    def draw(self, batch: int, seq: int, kept: int, device: torch.device) -> torch.Tensor:
        """[batch, kept] positions, each row a uniform random subset in increasing order ([Note: random-LTD
        randomness])."""
        key = (*self.source.draw_key(), self.layer_index)
        digest = hashlib.blake2b(struct.pack("<5q", *key), digest_size=8).digest()
        generator = torch.Generator(device=device)
        generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        scores = torch.rand(batch, seq, generator=generator, device=device)
        return scores.topk(kept, dim=1).indices.sort(dim=1).values

    # --- arguments -----------------------------------------------------------------------------------
    def _substitute(self, bound: inspect.BoundArguments, index: torch.Tensor, seq: int) -> None:
        named = dict(bound.arguments)
        extra = named.pop(self.var_kwargs, {}) if self.var_kwargs else {}
        for group in (named, extra):
            # the cache first: a past is the cause when the mask is longer than the sequence
            for name, value in sorted(group.items(), key=lambda item: item[0] not in _CACHE_NAMES):
                if name != self.hidden_name:
                    group[name] = self._subset_argument(name, value, index, seq)
        bound.arguments.update(named)
        if self.var_kwargs:
            bound.arguments[self.var_kwargs] = extra

    def _subset_argument(self, name: str, value: Any, index: torch.Tensor, seq: int) -> Any:
        where = f"random_ltd (layer {self.layer_index}, {type(self.layer).__name__}): argument {name!r}"
        if name in _CACHE_NAMES:
            return _fresh_cache(value, self.layer_index, where)
        if isinstance(value, _PASS_THROUGH):
            return value
        if name == self.mask_name:
            return _subset_mask(value, index, seq, where)
        if name == "position_ids" and isinstance(value, torch.Tensor) and value.dim() == 2 and not self.seq_first:
            return _gather_rows(value, index)
        if name == "position_embeddings" and isinstance(value, tuple) and not self.seq_first:
            return tuple(_gather_rows(part, index) for part in value)
        raise TypeError(f"{where}: random-LTD does not know how to cut it to the kept tokens; got "
                        f"{_describe(value)}. Drop random_ltd for this model or pass the argument as None.")

    def _scatter_output(self, output: Any, hidden: torch.Tensor, index: torch.Tensor) -> Any:
        if isinstance(output, torch.Tensor):
            return _scatter_tokens(hidden, output, index, self.seq_first)
        if isinstance(output, tuple) and output and all(item is None for item in output[1:]):
            return (_scatter_tokens(hidden, output[0], index, self.seq_first), *output[1:])
        raise TypeError(f"random_ltd (layer {self.layer_index}, {type(self.layer).__name__}): the layer returned "
                        f"{_describe(output)}; random-LTD puts back a tensor or a tuple (hidden states, None, ...) "
                        "only, as attention weights or caches of the kept tokens would be wrong for the sequence. "
                        "Turn off output_attentions / use_cache in training, or drop random_ltd.")


def _fresh_cache(cache: Any, layer_index: int, where: str) -> Any:
    """A cache that holds nothing for this layer yet does not change what the layer computes (it only records
    the kept tokens' keys); one with past tokens would mix the past with a subset, so it is refused."""
    if cache is None:
        return None
    length = getattr(cache, "get_seq_length", None)
    if length is None or length(layer_index) != 0:
        raise ValueError(f"{where}: a key/value cache with past tokens in training; got {_describe(cache)}. "
                         "random-LTD drops tokens only in training without past keys; call the model without "
                         "past_key_values in training.")
    return cache


def _subset_mask(mask: Any, index: torch.Tensor, seq: int, where: str) -> torch.Tensor:
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == seq:
        return _gather_rows(mask, index)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == seq and mask.shape[-2] in (1, seq):
        batch, kept = index.shape
        full = mask.expand(batch, mask.shape[1], mask.shape[2], seq)
        if mask.shape[-2] == seq:
            rows = index[:, None, :, None].expand(batch, mask.shape[1], kept, seq)
            full = full.gather(2, rows)
        cols = index[:, None, None, :].expand(batch, mask.shape[1], full.shape[2], kept)
        return full.gather(3, cols)
    raise TypeError(f"{where}: an attention mask of shape [batch, seq] or [batch, heads, seq or 1, seq] (seq "
                    f"{seq}) is required to cut it to the kept tokens; got {_describe(mask)}. Use an eager or "
                    "sdpa attention implementation, or drop random_ltd.")


def _gather_rows(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """value [batch or 1, seq, ...] -> [batch, kept, ...] at `index`."""
    batch, kept = index.shape
    value = value.expand(batch, *value.shape[1:])
    return value.gather(1, index.reshape(batch, kept, *[1] * (value.dim() - 2)).expand(batch, kept, *value.shape[2:]))


def _gather_tokens(hidden: torch.Tensor, index: torch.Tensor, seq_first: bool) -> torch.Tensor:
    if seq_first:
        return _gather_rows(hidden.transpose(0, 1), index).transpose(0, 1)
    return _gather_rows(hidden, index)


def _scatter_tokens(hidden: torch.Tensor, part: torch.Tensor, index: torch.Tensor, seq_first: bool) -> torch.Tensor:
    """A copy of `hidden` with the kept positions replaced by the layer's output (autograd: out-of-place scatter)."""
    full, part = (hidden.transpose(0, 1), part.transpose(0, 1)) if seq_first else (hidden, part)
    where = index[..., None].expand(*index.shape, full.shape[-1])
    out = full.to(part.dtype).scatter(1, where, part)
    return out.transpose(0, 1) if seq_first else out


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(_describe(v) for v in value)})"
    return f"a {type(value).__name__}"
