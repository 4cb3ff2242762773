"""How one module is split over the tensor-parallel group (a "style"), applied in place.

Styles act on the innermost weight-holding modules (`nn.Linear`, Hugging Face's `Conv1D`, `nn.Embedding`);
the module objects and their parameter names stay, so optimizers, PEFT and checkpoints see the same model,
only smaller. A PEFT LoRA wrapper is split through its parts so that every parameter left whole gets the
same, complete gradient on every tensor-parallel rank (nothing to all-reduce after backward):
- column-parallel `base_layer`: `lora_B` is split like it (its input is all-reduced backward), `lora_A` stays whole;
- row-parallel `base_layer`: `lora_A` is split like it (its output is all-reduced), `lora_B` stays whole.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .comm import SharedCopyIn, TensorLink, gather_last, gather_seq, reduce_out, reduce_scatter_seq, scatter_seq
from .shard import TensorShard, local_index, take

COLWISE, ROWWISE, EMBEDDING, LM_HEAD, GRAD_SUM = "colwise", "rowwise", "vocab_embedding", "colwise_gather", "grad_sum"
SEQ_SCATTER, SEQ_ENTER, SEQ_GATHER = "sequence_scatter", "sequence_enter", "sequence_gather"
"""Sequence parallelism: where the region begins (the module's input keeps 1/size of the tokens); a block of split
layers (attention, MLP) whose input is gathered whole on entry (its backward, a reduce-scatter, sums the split
layers' partial input gradients, so they need no entry op of their own); where the region ends (the module's
output is made whole; its own parameters saw 1/size of the tokens, so their gradients are summed)."""
STYLES = (COLWISE, ROWWISE, EMBEDDING, LM_HEAD, GRAD_SUM, SEQ_SCATTER, SEQ_ENTER, SEQ_GATHER)


class TensorParallelError(ValueError):
    """A model, plan or size that tensor parallelism cannot split as asked."""


@dataclass
class Sharder:
    """Splits modules over `link`, remembering which new parameter replaced which old one (tied weights are
    split once and stay tied) and each split parameter's `TensorShard`."""

    link: TensorLink
    sequence_parallel: bool = False
    """Split layers take and give sequence-sharded activations (all-gather in, reduce-scatter out)."""

    def __post_init__(self) -> None:
        self.replaced: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        """id(whole parameter) -> (it, its split replacement). The whole one is held until splitting ends: a freed
        parameter's id could be reused by one not yet split, which would then be taken for a tied copy."""
        self.shards: dict[int, TensorShard] = {}
        self.copy_in = SharedCopyIn(self.link)

    def apply(self, name: str, module: torch.nn.Module, style: str, blocks: int = 1) -> None:
        if style not in STYLES:
            raise TensorParallelError(f"{name}: unknown tensor-parallel style {style!r}; one of {', '.join(STYLES)}.")
        if _is_lora(module):
            self._lora(name, module, style, blocks)
        elif style == GRAD_SUM:
            self._grad_sum(module)
        elif style in (SEQ_SCATTER, SEQ_ENTER, SEQ_GATHER):
            self._sequence_boundary(module, style)
        elif isinstance(module, torch.nn.Embedding) and style == EMBEDDING:
            self._embedding(name, module)
        elif linear_kind(module) is not None and style in (COLWISE, ROWWISE, LM_HEAD):
            self._linear(name, module, style, blocks)
        else:
            raise TensorParallelError(
                f"{name}: a {type(module).__name__} cannot be split as {style!r}; column/row-parallel styles take "
                "nn.Linear or transformers' Conv1D (or a PEFT LoRA wrapper of one), vocab_embedding takes nn.Embedding. "
                "Leave it out of the plan (it stays whole on every rank) or give it a style its type supports.")

    def _split(self, name: str, module: torch.nn.Module, attr: str, dim: int, blocks: int = 1) -> None:
        param = getattr(module, attr)
        if id(param) in self.replaced:  # tied to a module split earlier
            new = self.replaced[id(param)][1]
            if self.shards[id(new)].dim != dim or self.shards[id(new)].full_shape != tuple(param.shape):
                raise TensorParallelError(f"{name}.{attr}: tied to a parameter split along another dim; split both "
                                          "modules alike or neither.")
            setattr(module, attr, new)
            return
        try:
            shard = TensorShard(dim, self.link.rank, self.link.size, tuple(param.shape), blocks)
        except ValueError as e:
            raise TensorParallelError(f"{name}.{attr} (shape {tuple(param.shape)}): {e}; choose a tensor-parallel size "
                                      "that divides it, or leave the module out of the plan.") from None
        with torch.no_grad():
            new = torch.nn.Parameter(take(param.detach(), shard).clone(), requires_grad=param.requires_grad)
        self.replaced[id(param)] = (param, new)
        self.shards[id(new)] = shard
        setattr(module, attr, new)

    def _linear(self, name: str, module: torch.nn.Module, style: str, blocks: int) -> None:
        conv1d = linear_kind(module) == "conv1d"  # weight is [in, out]
        out_dim, in_dim = (1, 0) if conv1d else (0, 1)
        link, shared = self.link, self.copy_in
        if style in (COLWISE, LM_HEAD):
            self._split(name, module, "weight", out_dim, blocks)
            if module.bias is not None:
                self._split(name, module, "bias", 0, blocks)
            if style == LM_HEAD or not self.sequence_parallel:  # SEQ_ENTER gathered a sequence-parallel input
                module.register_forward_pre_hook(lambda _, args: (shared(args[0]), *args[1:]))
            if style == LM_HEAD:
                module.register_forward_hook(_gather_logits(link, shared))
        else:
            self._split(name, module, "weight", in_dim)
            out = reduce_scatter_seq if self.sequence_parallel else reduce_out
            module.forward = types.MethodType(_row_forward(conv1d, link, out, shared), module)
        _set_features(module, conv1d)

    def _embedding(self, name: str, module: torch.nn.Embedding) -> None:
        self._split(name, module, "weight", 0)
        module.num_embeddings = module.weight.shape[0]
        module.forward = types.MethodType(_vocab_embedding_forward(self.link), module)

    def _lora(self, name: str, module: torch.nn.Module, style: str, blocks: int) -> None:
        if style not in (COLWISE, ROWWISE):
            raise TensorParallelError(f"{name}: a LoRA-wrapped layer can be split column- or row-wise, not {style!r}.")
        self.apply(f"{name}.base_layer", module.base_layer, style, blocks)
        split, parts = ("lora_B", COLWISE) if style == COLWISE else ("lora_A", ROWWISE)
        for adapter, layer in getattr(module, split).items():
            if blocks != 1:
                raise TensorParallelError(f"{name}: LoRA on a fused ({blocks}-block) projection is not split by "
                                          "shardwise; target the unfused projections or leave it out of the plan.")
            if layer.bias is not None and style == ROWWISE:
                raise TensorParallelError(f"{name}.{split}.{adapter}: a row-split LoRA layer with a bias is not supported.")
            self._linear(f"{name}.{split}.{adapter}", layer, parts, 1)
        if self.sequence_parallel:  # the adapter left whole sees 1/size of the tokens
            for layer in getattr(module, "lora_A" if style == COLWISE else "lora_B").values():
                self._grad_sum(layer)
        module.in_features, module.out_features = module.base_layer.in_features, module.base_layer.out_features

    def _grad_sum(self, module: torch.nn.Module) -> None:
        """Parameters kept whole whose gradient is partial on each rank (a norm applied to split heads): the
        gradient is summed over the tensor-parallel group as it is computed."""
        link = self.link
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(lambda grad: link.all_reduce(grad.clone()))

    def _sequence_boundary(self, module: torch.nn.Module, style: str) -> None:
        if not self.sequence_parallel:
            raise TensorParallelError(f"{style}: a sequence-parallel style needs tensor_parallel.sequence_parallel: true.")
        link = self.link
        if style == SEQ_GATHER:
            module.register_forward_hook(lambda _, __, out: gather_seq(out, link, partial_grad=False))
            self._grad_sum(module)
            return
        op = scatter_seq if style == SEQ_SCATTER else gather_seq
        module.register_forward_pre_hook(lambda _, args, kwargs: _on_hidden(op, link, args, kwargs), with_kwargs=True)


def _on_hidden(op: Callable, link: TensorLink, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`op` applied to a block's hidden states, given positionally or as `hidden_states=` (as transformers calls)."""
    if args:
        return (op(args[0], link), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": op(kwargs["hidden_states"], link)}


def linear_kind(module: torch.nn.Module) -> str | None:
    """"linear" (nn.Linear, weight [out, in]), "conv1d" (transformers' Conv1D, weight [in, out]) or None."""
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return "conv1d"
    return None


def _is_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def _set_features(module: torch.nn.Module, conv1d: bool) -> None:
    if conv1d:
        module.nf = module.weight.shape[1]
    else:
        module.out_features, module.in_features = module.weight.shape


def _gather_logits(link: TensorLink, shared: SharedCopyIn) -> Callable:
    """The LM head's forward hook: its output made whole over the vocabulary; its input copy is released."""

    def hook(_: torch.nn.Module, __: tuple, out: torch.Tensor) -> torch.Tensor:
        shared.release()
        return gather_last(out, link)

    return hook


def _row_forward(conv1d: bool, link: TensorLink, reduce: Callable, shared: SharedCopyIn) -> Callable:
    """A row-parallel layer: partial products summed over the group (`reduce`: all-reduce, or reduce-scatter
    along the sequence), then the (whole) bias added once. It closes the block whose column-parallel layers shared
    an input copy: that copy is released."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared.release()
        partial = x @ self.weight if conv1d else F.linear(x, self.weight)
        out = reduce(partial, link)
        return out + self.bias if self.bias is not None else out

    return forward


def _vocab_embedding_forward(link: TensorLink) -> Callable:
    """Each rank looks up the ids in its vocabulary slice (zeros elsewhere); the sum over the group is the
    whole lookup."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = link.rank * self.num_embeddings
        local, outside = local_index(ids, start, self.num_embeddings)
        pad = self.padding_idx - start if self.padding_idx is not None and 0 <= self.padding_idx - start < self.num_embeddings else None
        rows = F.embedding(local, self.weight, pad, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        return reduce_out(rows.masked_fill(outside.unsqueeze(-1), 0.0), link)

    return forward
