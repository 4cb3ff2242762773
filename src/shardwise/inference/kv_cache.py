"""The key/value cache generation runs with: Hugging Face's `StaticCache`, preallocated at `max_out_tokens`
positions and updated in place, so every decoding step has the same shapes (what `torch.compile` and CUDA graphs
need). Its tensors are sized from the first key/value states it sees, so on a tensor-parallel rank it holds only
that rank's heads. One cache is kept per batch size and reset between calls rather than allocated again.
"""

from __future__ import annotations

import torch


class StaticCaches:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._cache = None
        self._batch = None

    @staticmethod
    def supports(module: torch.nn.Module) -> bool:
        config = getattr(module, "config", None)
        return config is not None and not getattr(config, "is_encoder_decoder", False) and \
            getattr(module, "_supports_static_cache", getattr(module, "_can_compile_fullgraph", True)) is not False

    def get(self, module: torch.nn.Module, batch: int):
        from transformers import StaticCache

        if self._cache is None or self._batch != batch:
            self._cache, self._batch = StaticCache(config=module.config, max_cache_len=self.max_tokens), batch
        else:
            self._cache.reset()
        return self._cache


def cache_keyword() -> str:
    """The keyword `generate` takes a cache by: `cache` since transformers 5.x, `past_key_values` before."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
