"""A small GPT for the demo and the benchmarks, shaped like nanoGPT.

Token + learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention, GELU MLP), a final
LayerNorm and an LM head that shares its weight with the token embedding. Initialized like GPT-2.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}).")


PRESETS: dict[str, GPTConfig] = {
    # 1.85M parameters; ~0.35 s per 16x128 micro-batch on one CPU core. At lr 3e-3 the loss falls from 5.6
    # to ~2.5 within 30 steps and to ~1.8 by step 300.
    "demo": GPTConfig(seq_len=128, n_layer=4, n_head=6, d_model=192),
    # 33.70M parameters: narrow and deep (27 blocks), so per-parameter overheads (hooks, buckets) show.
    "bench33m": GPTConfig(seq_len=1024, n_layer=27, n_head=5, d_model=320),
    # 100.2M parameters: GPT-2-small width.
    "bench100m": GPTConfig(seq_len=1024, n_layer=14, n_head=12, d_model=768),
}


def preset(name: str, **overrides: object) -> GPTConfig:
    """The named preset, with any field replaced (e.g. `preset("demo", seq_len=256)`)."""
    if name not in PRESETS:
        raise ValueError(f"preset: must be one of {sorted(PRESETS)}; got {name!r}.")
    return dataclasses.replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.is_residual_projection = True  # read once by GPT._init_weights

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).split(D, dim=2)
        # (B, S, D) -> (B, heads, S, head_dim)
        q, k, v = (t.view(B, S, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.proj.is_residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one parameter, counted once
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                # GPT-2: each block adds two residual branches; keep the residual stream's variance flat.
                std /= math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy over all positions when `labels` is given, else logits `(B, S, vocab)`."""
        S = input_ids.shape[1]
        if S > self.cfg.seq_len:
            raise ValueError(f"input_ids: at most seq_len={self.cfg.seq_len} tokens; got {S}.")
        positions = torch.arange(S, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: append the most likely next token `max_new_tokens` times (no KV cache)."""
        for _ in range(max_new_tokens):
            logits = self(input_ids[:, -self.cfg.seq_len :])  # the position table ends at seq_len
            input_ids = torch.cat([input_ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return input_ids

    def param_groups(self) -> list[dict[str, object]]:
        """nanoGPT's optimizer groups: weight decay on matrices (weights, embeddings), none on biases and norms.

        The first group takes the optimizer's configured weight_decay; the second overrides it to 0.
        """
        params = list(self.parameters())
        return [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    def num_parameters(self) -> int:
        """Distinct parameters (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())


def from_preset(name: str = "demo", **overrides: object) -> GPT:
    """A factory for tools that build a model by name (`shardwise plan --model examples.demo.model:from_preset`)."""
    return GPT(preset(name, **overrides))
