"""Flops profiler: exact FLOPs of a Linear, a conv, an attention block and a tiny GPT against hand-computed
values; module tree, depth limiting, top modules; DeepSpeed's `get_model_profile` surface.

Counted FLOPs are matrix products, convolutions and attention at 2 per multiply-accumulate. The
attention backward is torch's formula for its flash kernels: 5 products of the forward's size (the
scores are recomputed), i.e. 2.5 × the forward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import shardwise.profiling
from shardwise.profiling import get_model_profile, profile_model
from shardwise.profiling.flops_report import render


def test_linear_forward_and_backward():
    model = torch.nn.Linear(8, 16)
    x = torch.randn(3, 8, requires_grad=True)
    p = profile_model(model, args=[x], backward=True, warm_up=0)
    assert p.fwd_flops == 2 * 3 * 8 * 16
    assert p.bwd_flops == 2 * (2 * 3 * 8 * 16)  # grad of input and of weight
    assert p.fwd_macs == 3 * 8 * 16 and p.params == 8 * 16 + 16
    # An input that needs no gradient: only the weight's gradient is computed.
    assert profile_model(model, input_shape=(3, 8), backward=True).bwd_flops == 2 * 3 * 8 * 16


def test_conv2d():
    model = torch.nn.Conv2d(3, 8, kernel_size=3, padding=1)
    p = profile_model(model, input_shape=(2, 3, 10, 10), backward=True)
    expected = 2 * 2 * 8 * 10 * 10 * 3 * 3 * 3  # 2 · batch · C_out · H · W · C_in · k²
    assert p.fwd_flops == expected and p.bwd_flops == expected


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def _attention_flops(b: int, t: int, d: int) -> tuple[int, int]:
    """(forward, backward) of the scores and the weighted sum, summed over heads."""
    one_product = 2 * b * t * t * d
    return 2 * one_product, 5 * one_product


def test_attention_block():
    b, t, d = 2, 8, 16
    x = torch.randn(b, t, d, requires_grad=True)
    p = profile_model(Attention(d, heads=2), args=[x], backward=True)
    attn_fwd, attn_bwd = _attention_flops(b, t, d)
    linear_fwd = 2 * b * t * d * 3 * d + 2 * b * t * d * d
    assert p.fwd_flops == linear_fwd + attn_fwd
    assert p.bwd_flops == 2 * linear_fwd + attn_bwd
    assert p.modules["qkv"].fwd_flops == 2 * b * t * d * 3 * d
    assert p.modules["proj"].bwd_flops == 2 * (2 * b * t * d * d)


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 128, layers: int = 2, heads: int = 4, seq: int = 8):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied output head
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt_profile(b=2, t=8):
    torch.manual_seed(0)
    model = TinyGPT(seq=t)
    idx = torch.randint(0, 64, (b, t))
    return model, profile_model(model, args=[idx, idx], backward=True, warm_up=0)


def test_tiny_gpt_exact_and_six_n_rule():
    b, t, d, layers, vocab = 2, 8, 128, 2, 64
    model, p = _gpt_profile(b, t)
    tokens = b * t
    matmul_weights = layers * 12 * d * d + vocab * d  # qkv 3d², proj d², mlp 8d² per layer; tied head
    attn_fwd, attn_bwd = _attention_flops(b, t, d)
    assert p.fwd_flops == 2 * tokens * matmul_weights + layers * attn_fwd
    assert p.bwd_flops == 4 * tokens * matmul_weights + layers * attn_bwd
    n_params = sum(q.numel() for q in model.parameters())
    six_n = 6 * n_params * tokens
    assert abs(p.flops - six_n) / six_n < 0.02
    # Per module: one block's attention is its two projections plus the attention itself.
    assert p.modules["blocks.0.attn"].fwd_flops == 2 * tokens * 4 * d * d + attn_fwd
    assert p.modules[""].fwd_flops == p.fwd_flops  # everything happens inside the model
    assert p.modules["blocks.1"].params == sum(q.numel() for q in model.blocks[1].parameters())


def test_module_tree_depth_limit_and_top_modules():
    _, p = _gpt_profile()
    full = render(p, "tiny GPT", module_depth=-1, top_k=2)
    shallow = render(p, "tiny GPT", module_depth=1, top_k=2)
    assert "blocks (ModuleList)" in full and "attn (Attention)" in full and "qkv (Linear)" in full
    assert "blocks (ModuleList)" in shallow and "attn (Attention)" not in shallow
    # Top modules at depth 1 by MACs: the blocks container, then the embedding (the tied head is not a module).
    top_line = next(line for line in shallow.splitlines() if line.strip().startswith("1 "))
    assert "blocks" in top_line
    terse = render(p, "tiny GPT", detailed=False)
    assert "Module tree" not in terse and "fwd FLOPs" in terse
    assert list(p.modules)[:3] == ["", "wte", "wpe"]
    assert p.modules["blocks.0.attn.qkv"].depth == 4


def test_get_model_profile_deepspeed_surface(tmp_path, capsys):
    assert shardwise.profiling.get_model_profile is get_model_profile
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    flops, macs, params = get_model_profile(model, input_shape=(3, 8), print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * 3 * (8 * 16 + 16 * 4), 3 * (8 * 16 + 16 * 4), 8 * 16 + 16 + 16 * 4 + 4)
    out = tmp_path / "profile.txt"
    as_text = get_model_profile(model, args=[torch.randn(3, 8)], output_file=str(out), module_depth=1)
    assert as_text == ("1.15 KFLOPS", "576 MACs", "212")
    text = out.read_text()
    assert "shardwise flops profiler" in text and "(root) (Sequential)" in text and "0 (Linear)" in text
    with pytest.raises(ValueError, match="no input"):
        get_model_profile(model)
    with pytest.raises(ValueError, match="either input_shape or args"):
        get_model_profile(model, input_shape=(3, 8), args=[torch.randn(3, 8)])


def test_forward_latency_is_measured_per_module():
    _, p = _gpt_profile()
    root = p.modules[""]
    assert root.fwd_latency_s > 0 and root.calls == 1
    children = sum(p.modules[f"blocks.{i}"].fwd_latency_s for i in range(2))
    assert children <= root.fwd_latency_s
    assert math.isclose(p.fwd_flops / 2, p.fwd_macs, abs_tol=1)


def test_uncalled_containers_show_their_childrens_sum():
    _, p = _gpt_profile()
    blocks = p.modules["blocks"]  # a ModuleList: iterated, never called
    assert blocks.calls == 0
    assert blocks.fwd_flops == p.modules["blocks.0"].fwd_flops + p.modules["blocks.1"].fwd_flops
    assert blocks.bwd_flops == p.modules["blocks.0"].bwd_flops + p.modules["blocks.1"].bwd_flops
