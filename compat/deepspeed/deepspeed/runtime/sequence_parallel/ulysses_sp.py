"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: Ulysses attention for transformers models, the loader
adapter, and ALST's tiled computations (shardwise.sequence_parallel)."""

from shardwise.sequence_parallel.deepspeed_api import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
