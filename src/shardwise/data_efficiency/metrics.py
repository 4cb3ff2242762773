"""Built-in metric functions for `DataAnalyzer`: sequence length, token counts and vocabulary rarity.

Each takes a collated batch: a (batch, sequence) integer tensor of token ids, or a dict holding one under
`key` (and, for the length, an `attention_mask`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch


def _tokens(batch: Any, key: str) -> torch.Tensor:
    tokens = batch[key] if isinstance(batch, dict) else batch
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise TypeError(f"metric: a (batch, sequence) tensor of token ids (or a dict with it under {key!r}) is "
                        f"required; got {type(tokens).__name__}. Pass a collate_fn that pads to one.")
    return tokens


def _kept(batch: Any, tokens: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    if isinstance(batch, dict) and "attention_mask" in batch:
        return batch["attention_mask"].bool()
    if pad_token_id is not None:
        return tokens != pad_token_id
    return torch.ones_like(tokens, dtype=torch.bool)


def seqlen(key: str = "input_ids", pad_token_id: int | None = None) -> Callable[[Any], np.ndarray]:
    """`single_value_per_sample`: tokens per sample (the attention mask's, else those not `pad_token_id`)."""

    def metric(batch: Any) -> np.ndarray:
        tokens = _tokens(batch, key)
        return _kept(batch, tokens, pad_token_id).sum(dim=1).to(torch.int64).numpy()

    return metric


def token_counts(vocab_size: int, key: str = "input_ids", pad_token_id: int | None = None) -> Callable[[Any], np.ndarray]:
    """`accumulate_value_over_samples`: how often each token id occurs (summed over the dataset by reduce)."""

    def metric(batch: Any) -> np.ndarray:
        tokens = _tokens(batch, key)
        kept = tokens[_kept(batch, tokens, pad_token_id)]
        return torch.bincount(kept.reshape(-1).long(), minlength=vocab_size).numpy()

    return metric


def vocab_rarity(counts: np.ndarray, key: str = "input_ids", pad_token_id: int | None = None) -> Callable[[Any], np.ndarray]:
    """`single_value_per_sample`: -sum over a sample's tokens of log p(token), p from `counts` (the
    token_counts metric's result; DeepSpeed's "vocabulary rarity"). Unseen tokens count as seen once."""
    counts64 = np.maximum(np.asarray(counts, dtype=np.float64), 1.0)
    neg_log_p = torch.from_numpy(np.log(counts64.sum()) - np.log(counts64))

    def metric(batch: Any) -> np.ndarray:
        tokens = _tokens(batch, key)
        kept = _kept(batch, tokens, pad_token_id).double()
        return (neg_log_p[tokens.long()] * kept).sum(dim=1).numpy()

    return metric
