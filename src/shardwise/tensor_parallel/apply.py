"""Split a model over the tensor-parallel group: match the plan's rules to its modules and apply their styles.

The model is built whole on every rank (same seed), then each rank keeps its shards: what the model computes is
unchanged, which the tests check against the single-process model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .comm import TensorLink
from .plans import HEAD_COUNTS, Rule, hf_config
from .shard import TensorShard
from .styles import COLWISE, Sharder, TensorParallelError

logger = logging.getLogger(__name__)


@dataclass
class TensorParallelModel:
    """What splitting did: each split parameter's shard by name, and the link its traffic goes through."""

    link: TensorLink
    shards: dict[str, TensorShard] = field(default_factory=dict)
    split_modules: dict[str, str] = field(default_factory=dict)
    """module name -> style, for the log and the tests."""

    split_ids: set[int] = field(default_factory=set)
    replaced: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    """id of a parameter before the split -> the parameter that replaced it."""

    def remap(self, groups: list[dict]) -> list[dict]:
        """Optimizer parameter groups over the split parameters (they were built over the whole ones)."""
        return [{**g, "params": [self.replaced.get(id(p), p) for p in g["params"]]} for g in groups]

    def is_split(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.split_ids

    def counts_in_norm(self, param: torch.nn.Parameter) -> bool:
        """A whole (replicated) parameter is counted in the gradient norm on tensor-parallel rank 0 only, so the
        sum over the group counts it once; a split one is counted on every rank (each holds a different part)."""
        return self.link.rank == 0 or self.is_split(param)


def parallelize(model: torch.nn.Module, rules: list[Rule], link: TensorLink) -> TensorParallelModel:
    """Split `model` in place: modules that declare a `tp_style` (shardwise.tensor_parallel.layers) and those a
    rule matches (first rule wins; "skip" leaves a module whole)."""
    _check_heads(model, link.size)
    # the whole parameters stay alive until the split is checked: the sharder knows them by id, and a freed one's
    # id could be given to a new shard, which would then look like a whole weight left behind
    whole = list(model.parameters())
    sharder = Sharder(link)
    result = TensorParallelModel(link)
    divided: set[str] = set()
    for name, module in list(model.named_modules()):
        style, blocks = _style_of(name, module, rules)
        if style is None or style == "skip":
            continue
        sharder.apply(name, module, style, blocks)
        result.split_modules[name] = style
        parent = name.rpartition(".")[0]
        if style == COLWISE and parent not in divided:
            divided.add(parent)
            _divide_head_counts(model.get_submodule(parent) if parent else model, link.size)
    _check_ties(model, sharder)
    del whole
    by_id = {id(p): n for n, p in model.named_parameters()}
    result.shards = {by_id[i]: shard for i, shard in sharder.shards.items() if i in by_id}
    result.split_ids = set(sharder.shards)
    result.replaced = dict(sharder.replaced)
    if not result.split_modules:
        raise TensorParallelError(f"tensor_parallel: the plan matched no module of {type(model).__name__}, so nothing "
                                  "would be split; check partition_config's patterns against model.named_modules().")
    logger.info("tensor parallel: split %d modules over %d ranks", len(result.split_modules), link.size)
    return result


def _style_of(name: str, module: torch.nn.Module, rules: list[Rule]) -> tuple[str | None, int]:
    declared = getattr(module, "tp_style", None)
    if declared is not None:
        return declared, 1
    if not name:
        return None, 1
    for rule in rules:
        if rule.matches(name):
            return rule.style, rule.blocks
    return None, 1


def _check_heads(model: torch.nn.Module, size: int) -> None:
    """Attention heads (and GQA's key/value heads) must split evenly, or a rank would hold part of a head."""
    config = hf_config(model)
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % size:
            raise TensorParallelError(f"tensor_parallel.autotp_size: {size} does not divide the model's {key} "
                                      f"({heads}), so heads would be cut; choose a size that divides it.")


def _divide_head_counts(attention: torch.nn.Module, size: int) -> None:
    """An attention module that counts its heads (OPT's num_heads, GPT-2's split_size) now has 1/size of them."""
    for attr in HEAD_COUNTS:
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, attr, value // size)


def _check_ties(model: torch.nn.Module, sharder: Sharder) -> None:
    """A parameter tied between a split module and a whole one would leave a full copy beside the shards and
    stop training them together: refuse, naming both."""
    replaced = set(sharder.replaced)
    stale = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in replaced]
    if stale:
        raise TensorParallelError(f"tensor_parallel: {stale[:5]} still hold the whole weight that another module now "
                                  "holds split (the two were tied); split both modules alike (add a rule for them) or "
                                  "set tensor_parallel.vocab_parallel_lm_head: false for embeddings.")
