"""Megatron-style layers for models written for tensor parallelism (a `PipelineModule`'s layers, say).

Each is the ordinary torch layer at its whole size plus the style it is split with: built alike on every rank
(same seed), it is split in place when `initialize` applies the tensor-parallel plan, so a model of these
layers at tensor-parallel size 1 is exactly the single-process model the tests compare against.
"""

from __future__ import annotations

import torch

from .styles import COLWISE, EMBEDDING, LM_HEAD, ROWWISE


class ColumnParallelLinear(torch.nn.Linear):
    """Output features split over the group; `gather_output` makes the output whole again (an LM head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False, **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.tp_style = LM_HEAD if gather_output else COLWISE


class RowParallelLinear(torch.nn.Linear):
    """Input features split over the group (the input is a column-parallel layer's split output); the partial
    products are summed over the group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.tp_style = ROWWISE


class VocabParallelEmbedding(torch.nn.Embedding):
    """Vocabulary rows split over the group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, **kw):
        super().__init__(num_embeddings, embedding_dim, **kw)
        self.tp_style = EMBEDDING
