"""The models `pipeline_parallel.py` trains as PipelineModules, and its count of bytes saved for backward.

- `sleep_specs`: layers whose compute is a timed sleep (forward F, backward 2F), on 1x4 tensors: a stage's
  time is the schedule's, not the machine's, even with 4 ranks on 2 cores.
- `block_specs`: tests/pipeline_models.py's Linear / Block / Head at a real width, for activation bytes.
- `gpt_specs`: the demo GPT of examples/demo/model.py (the bench presets) as LayerSpecs: token embedding
  (tied with the head, as in the GPT), positions, the blocks, the final norm, the head.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

SLEEP_WIDTH = 4


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(torch.nn.Module):
    """A tiny Linear (so the stage has parameters and gradients to reduce), then a sleep of `forward_s` in
    forward and `backward_s` in backward."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.fc = torch.nn.Linear(SLEEP_WIDTH, SLEEP_WIDTH)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.fc(x), self.forward_s, self.backward_s)


def sleep_specs(stages: int, stage_forward_ms: float) -> list[Any]:
    """2 * stages sleep layers, each half a stage's forward: two per stage with one chunk, one per chunk with
    two (interleaved), so a stage's work per micro-batch is the same under every schedule."""
    from shardwise.pipe import LayerSpec

    half = stage_forward_ms / 2000
    return [LayerSpec(SleepLayer, half, 2 * half) for _ in range(2 * stages)]


def block_specs(width: int, blocks: int, in_width: int, out_width: int) -> list[Any]:
    from shardwise.pipe import LayerSpec
    from tests.pipeline_models import Block, Head

    return [LayerSpec(torch.nn.Linear, in_width, width), *[LayerSpec(Block, width) for _ in range(blocks)],
            LayerSpec(Head, width, out_width)]


def mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, labels)


class Positions(torch.nn.Module):
    """The GPT's learned position embedding, added to the token embedding's output."""

    def __init__(self, seq_len: int, d_model: int):
        super().__init__()
        self.pos_emb = torch.nn.Embedding(seq_len, d_model)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return x_BSD + self.pos_emb(torch.arange(x_BSD.shape[1], device=x_BSD.device))


def lm_head(embedding: torch.nn.Embedding, x_BSD: torch.Tensor) -> torch.Tensor:
    """The GPT's head: logits through the token embedding's weight (tied)."""
    return F.linear(x_BSD, embedding.weight)


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def gpt_specs(cfg: Any) -> list[Any]:
    from examples.demo.model import Block
    from shardwise.pipe import LayerSpec, TiedLayerSpec

    return [TiedLayerSpec("embed", torch.nn.Embedding, cfg.vocab_size, cfg.d_model),
            LayerSpec(Positions, cfg.seq_len, cfg.d_model), *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
            LayerSpec(torch.nn.LayerNorm, cfg.d_model),
            TiedLayerSpec("embed", torch.nn.Embedding, cfg.vocab_size, cfg.d_model, forward_fn=lm_head)]


def init_like_gpt(module: torch.nn.Module) -> None:
    """N(0, 0.02) weights and zero biases, as the GPT starts (its residual-projection scaling left out: the
    step time does not depend on it)."""
    for sub in module.modules():
        if isinstance(sub, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(sub.weight, mean=0.0, std=0.02)
        if isinstance(sub, torch.nn.Linear) and sub.bias is not None:
            torch.nn.init.zeros_(sub.bias)


def param_groups(module: torch.nn.Module) -> list[dict[str, Any]]:
    """The GPT's optimizer groups: weight decay on matrices only."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class SavedBytes:
    """Live bytes of the tensors autograd saves for backward, and their peak, through
    `torch.autograd.graph.saved_tensors_hooks`. A storage saved by several nodes counts once; parameters
    (the storages in `exclude`) do not count: they live anyway. A saved tensor stops counting when autograd
    drops it (after its backward, or when its graph is freed)."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.live = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [references, bytes]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or ptr == 0:
            return tensor
        entry = self._storages.setdefault(ptr, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Saved(self, tensor, ptr)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, ptr: int) -> None:
        entry = self._storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[ptr]


class _Saved:
    """A saved tensor as autograd holds it: when autograd lets it go, its bytes stop counting."""

    def __init__(self, counter: SavedBytes, tensor: torch.Tensor, ptr: int):
        self.counter, self.tensor, self.ptr = counter, tensor, ptr

    def __del__(self) -> None:
        self.counter.release(self.ptr)
