"""Tensor (Megatron-style) parallelism: layers split over a tensor-parallel group, and AutoTP, which splits a
Hugging Face model by a plan per architecture.

`initialize` applies it when the config asks for `tensor_parallel.autotp_size` > 1 (or a Megatron-style `mpu`
says so): the model, built whole on every rank, keeps each rank's shards. Collectives go through the
collectives choke point (counted, bounded); the parameters stay plain tensors, so every ZeRO stage works on the
shards unchanged, and each split parameter's place in the whole one (`TensorShard`) is what checkpoints record.
"""

from .apply import TensorParallelModel, parallelize
from .comm import TensorLink, copy_in, gather_last, reduce_out, split_last
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy
from .plans import BUILT_IN, Rule, resolve_plan
from .shard import TensorShard, assemble, take
from .styles import TensorParallelError

__all__ = ["BUILT_IN", "ColumnParallelLinear", "Rule", "RowParallelLinear", "TensorLink", "TensorParallelError",
           "TensorParallelModel", "TensorShard", "VocabParallelEmbedding", "assemble", "copy_in", "gather_last",
           "parallelize", "reduce_out", "resolve_plan", "split_last", "take", "vocab_parallel_cross_entropy"]
