"""Ulysses sequence parallelism: `sequence_parallel_size` ranks share each sequence (link.py); attention
exchanges tokens for heads and back (exchange.py, attention.py; hf.py for transformers models); the loader
adapter cuts batches along the sequence (data.py) and the loss is weighed by each rank's tokens (loss.py);
setup.py is the wiring at initialize. ALST's memory tricks, usable without it: tiled.py, tiled_loss.py, offload.py.
"""

from .attention import UlyssesAttention, kv_replication
from .data import SequenceShardLoader
from .hf import register_with_transformers, unregister_from_transformers
from .link import SequenceLink, SequenceParallelError, recorded_link, sequence_link
from .loss import combine_loss
from .offload import offload_checkpoints, offloaded_checkpoint
from .tiled import tile_forward, tiled_mlp
from .tiled_loss import tiled_cross_entropy

__all__ = ["SequenceLink", "SequenceParallelError", "SequenceShardLoader", "UlyssesAttention", "combine_loss",
           "kv_replication", "offload_checkpoints", "offloaded_checkpoint", "recorded_link",
           "register_with_transformers", "sequence_link", "tile_forward", "tiled_cross_entropy", "tiled_mlp",
           "unregister_from_transformers"]
