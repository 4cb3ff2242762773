"""DeepSpeed's `ulysses_sp` classes under their names and signatures, over shardwise's Ulysses.

`UlyssesSPAttentionHF.register_with_transformers(...)` returns the mpu (DeepSpeed's `parallel_state_sp`, here
`mpu.py`) that accelerate passes to `initialize`. Sequence lengths and micro-batch sizes are accepted for the
signature and not needed: the shapes are read from each call.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import Collectives, Group
from . import mpu as sequence_mpu
from .attention import UlyssesAttention
from .data import SequenceShardLoader
from .hf import register_with_transformers
from .link import SequenceLink, SequenceParallelError, recorded_link, sequence_link

def link_of(process_group: Any) -> SequenceLink:
    """The link over `process_group`: this process's recorded one when it is that group."""
    link = recorded_link()
    if link is not None and link.group.pg is process_group:
        return link
    if process_group is None:
        raise SequenceParallelError("sp_group: a sequence-parallel process group is required; got None. Build it "
                                    "with register_with_transformers or initialize_sequence_parallel(size).")
    group = Group("sequence", process_group, dist.get_world_size(process_group), dist.get_rank(process_group))
    return SequenceLink(group, link.comm if link is not None else Collectives())

class UlyssesSPAttentionHF(nn.Module):
    """Ulysses around `attn` (a transformers attention function) over `process_group`."""

    def __init__(self, attn: Any, batch_size: int = 0, attn_head_count: int = 0, attn_head_size: int = 0,
                 kv_head_count: int = 0, num_hidden_layers: int = 0, process_group: Any = None,
                 seq_length_is_variable: bool = False, local_seq_length: int | None = None,
                 global_seq_length: int | None = None, disable_in_eval: bool = False) -> None:
        super().__init__()
        self.ulysses = UlyssesAttention(attn, link_of(process_group), disable_in_eval)
        self.attn, self.process_group = attn, process_group
        self.world_size, self.sp_rank = self.ulysses.link.size, self.ulysses.link.rank

    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return self.ulysses(module, query, key, value, attention_mask, *args, **kwargs)

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> types.ModuleType | None:
        if sequence_parallel_size == 1:
            return None
        if not seq_length_is_variable and (seq_length or max_length) is None:
            raise SequenceParallelError("register_with_transformers: seq_length is required when "
                                        "seq_length_is_variable is False; got neither seq_length nor max_length.")
        model = model_name_or_path
        if isinstance(model, str):
            from transformers import AutoConfig

            model = AutoConfig.from_pretrained(model)
        register_with_transformers(model, sequence_link(sequence_parallel_size), core_attn_implementation,
                                   disable_in_eval)
        return sequence_mpu

class UlyssesSPDataLoaderAdapter(SequenceShardLoader):
    """DeepSpeed's adapter: `dl`'s batches cut along the sequence over `sp_group`."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        link = link_of(sp_group)
        if (link.rank, link.size) != (sp_rank, sp_world_size):
            raise SequenceParallelError(
                f"UlyssesSPDataLoaderAdapter: sp_rank {sp_rank} and sp_world_size {sp_world_size} differ from the "
                f"group's ({link.rank} of {link.size}); pass the group's own rank and size.")
        super().__init__(dl, link, device)
