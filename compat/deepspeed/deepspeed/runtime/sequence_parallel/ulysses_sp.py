"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: Ulysses attention for transformers models, the loader
adapter, and ALST's tiled computations (shardwise.sequence_parallel)."""

from shardwise.sequence_parallel.deepspeed_api import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from shardwise.sequence_parallel.tiled import SequenceTiledCompute, TiledMLP, sequence_tiled_compute
from shardwise.sequence_parallel.tiled_loss import TiledFusedLogitsLoss

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]
