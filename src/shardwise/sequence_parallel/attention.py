"""Ulysses attention: each rank holds `1/size` of the sequence; around the core attention an all-to-all gives
each rank `1/size` of the heads over the whole sequence, and another gives the tokens back.

The wrapped function has Hugging Face's attention signature (`module, query, key, value, attention_mask, **kw`
with q/k/v `[batch, heads, local_seq, head_dim]`, returning `[batch, seq, heads, head_dim]`), so a model built
on transformers' attention registry, or any model whose attention calls such a function, runs unchanged.

Causality comes from the core's causal flag over the gathered sequence, not from a mask: the mask the model
built is for its local shard (wrong once the sequence is gathered, and `seq²` in size), so it is dropped. That
is right for causal attention with padding on the right only (`data.py` refuses other padding), and wrong for
masks that carry more (sliding windows, bidirectional models, the eager core, which needs the mask): those are
refused here rather than run without their mask.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .exchange import exchange
from .link import SequenceLink, SequenceParallelError

HEADS, SEQ = 1, 2
"""q/k/v are [batch, heads, seq, head_dim]."""
OUT_SEQ, OUT_HEADS = 1, 2
"""The core's output is [batch, seq, heads, head_dim]."""

CoreAttention = Callable[..., tuple[torch.Tensor, Any]]


def kv_replication(q_heads: int, kv_heads: int, size: int) -> int:
    """How many copies of each key/value head let `size` ranks each hold whole groups of them: 1 when the kv
    heads divide evenly, else the fewest copies that do (at most the query heads per kv head, which is MHA)."""
    if q_heads % size:
        raise SequenceParallelError(
            f"sequence_parallel_size: {size} ranks must each hold a whole number of the model's {q_heads} attention "
            f"heads; choose a sequence-parallel size that divides {q_heads}.")
    if q_heads % kv_heads:
        raise SequenceParallelError(f"attention: {q_heads} query heads cannot share {kv_heads} key/value heads evenly.")
    group = q_heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % size == 0)


class UlyssesAttention:
    """`core` (an attention function of Hugging Face's signature) over the whole sequence held by `link`'s
    ranks. `disable_in_eval`: a module in eval mode attends over its own tokens only (as DeepSpeed's option)."""

    def __init__(self, core: CoreAttention, link: SequenceLink, disable_in_eval: bool = False):
        self.core, self.link, self.disable_in_eval = core, link, disable_in_eval

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if self.link.size == 1 or (self.disable_in_eval and not module.training):
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        _refuse_masks_it_would_drop(module, query, key, kwargs)
        copies = kv_replication(query.shape[HEADS], key.shape[HEADS], self.link.size)
        if copies > 1:
            key, value = key.repeat_interleave(copies, HEADS), value.repeat_interleave(copies, HEADS)
        self.link.exchanges += 1
        query, key, value = (exchange(t, self.link, HEADS, SEQ) for t in (query, key, value))
        if torch.is_tensor(kwargs.get("position_ids")):  # some cores read them (packed-sequence boundaries)
            kwargs["position_ids"] = torch.cat(self.link.all_gather_rows(kwargs["position_ids"]), dim=-1)
        saved = getattr(module, "num_key_value_groups", None)
        if saved is not None:  # the core repeats kv heads by it; on this rank's heads the ratio may differ
            module.num_key_value_groups = query.shape[HEADS] // key.shape[HEADS]
        try:
            out, _ = self.core(module, query, key, value, None, *args, **kwargs)
        finally:
            if saved is not None:
                module.num_key_value_groups = saved
        return exchange(out, self.link, OUT_SEQ, OUT_HEADS), None


def _refuse_masks_it_would_drop(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                                kwargs: dict[str, Any]) -> None:
    where = type(module).__name__
    if query.shape[SEQ] != key.shape[SEQ]:
        raise SequenceParallelError(
            f"{where}: {key.shape[SEQ]} keys for {query.shape[SEQ]} queries (a key/value cache); sequence parallelism "
            "trains over whole sequences. Generate with use_cache=False, or without sequence parallelism.")
    if getattr(module, "is_causal", True) is not True:
        raise SequenceParallelError(
            f"{where}: bidirectional attention needs its padding mask, which Ulysses attention cannot carry over the "
            "gathered sequence; sequence parallelism is built for causal (decoder) models.")
    if kwargs.get("sliding_window") is not None:
        raise SequenceParallelError(
            f"{where}: sliding-window attention (window {kwargs['sliding_window']}) comes from the mask, which Ulysses "
            "attention drops; turn the window off (config.use_sliding_window = False) or train without sequence "
            "parallelism.")
