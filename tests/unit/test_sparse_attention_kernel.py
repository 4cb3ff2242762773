"""SparseSelfAttention's numbers against plain attention written here: softmax(QKᵀ/√d) V with the layout
expanded to a boolean [S, S] mask. SDPA and block-gather paths: forward and gradients; flex path: forward
(torch 2.13's flex_attention has no CPU backward; tests/gpu/test_sparse_attention_gpu.py checks its
gradients on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.sparse_attention import kernel
from shardwise.sparse_attention.block_gather import bucket_width, build_plan
from shardwise.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                        FixedSparsityConfig, SparseAttentionInputError, SparseSelfAttention,
                                        VariableSparsityConfig)

HEADS, SEQ, DIM, BLOCK = 2, 32, 8, 4


def qkv(seed: int = 0, batch: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, HEADS, SEQ, DIM, generator=g, requires_grad=True) for _ in range(3)]


def plain_attention(q, k, v, layout, block, causal, bias=None, keep=None):
    """The reference: every score, then the mask; a query with nothing to attend to outputs 0."""
    allowed = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
    if causal:
        allowed = allowed & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if keep is not None:
        allowed = allowed & keep
    scores = q @ k.transpose(-1, -2) / DIM ** 0.5
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, -float("inf"))
    has_any = (scores > -float("inf")).any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~has_any, 0.0), dim=-1) * has_any
    return probs @ v


def configs(attention, per_head=False):
    """`per_head`: each head its own layout (random blocks differ per head; fixed gets two global patterns)."""
    common = {"block": BLOCK, "attention": attention, "different_layout_per_head": per_head}
    return {
        "fixed": FixedSparsityConfig(HEADS, num_local_blocks=2, num_different_global_patterns=2 if per_head else 1,
                                     **common),
        "bigbird": BigBirdSparsityConfig(HEADS, num_random_blocks=1, **common),
        "variable": VariableSparsityConfig(HEADS, num_random_blocks=1, local_window_blocks=[1, 3],
                                           global_block_indices=[2], **common),
        "bslongformer": BSLongformerSparsityConfig(HEADS, global_block_indices=[1], **common),
    }


def grads_close(out, ref, inputs):
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "blocks"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_equals_sdpa_forward_and_gradients(causal, backend):
    q, k, v = qkv()
    attention = "unidirectional" if causal else "bidirectional"
    out = SparseSelfAttention(DenseSparsityConfig(HEADS, block=BLOCK, attention=attention), max_seq_length=SEQ,
                              backend=backend)(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads_close(out, ref, (q, k, v))
    with torch.no_grad():
        flex = SparseSelfAttention(DenseSparsityConfig(HEADS, block=BLOCK, attention=attention), max_seq_length=SEQ,
                                   backend="flex")(q, k, v)
    torch.testing.assert_close(flex, ref.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "blocks"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
@pytest.mark.parametrize("mode", ["fixed", "bigbird", "variable", "bslongformer"])
def test_sparse_modes_equal_plain_masked_attention(mode, attention, per_head, backend):
    config = configs(attention, per_head)[mode]
    module = SparseSelfAttention(config, max_seq_length=64, backend=backend)
    layout = config.make_layout(64)[:, :SEQ // BLOCK, :SEQ // BLOCK]  # DeepSpeed cuts the max-length layout
    assert 0 < layout.float().mean() < 1
    q, k, v = qkv(1)
    out = module(q, k, v)
    ref = plain_attention(q, k, v, layout, BLOCK, attention == "unidirectional")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads_close(out, ref, (q, k, v))
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=attention == "unidirectional"))


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_sparse_modes_equal_plain_masked_attention_flex(attention):
    q, k, v = (t.detach() for t in qkv(2))
    for mode, config in configs(attention).items():
        with torch.no_grad():
            out = SparseSelfAttention(config, max_seq_length=SEQ, backend="flex")(q, k, v)
        ref = plain_attention(q, k, v, config.make_layout(SEQ), BLOCK, attention == "unidirectional")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=mode)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "blocks"])
def test_masks_modes_and_fully_masked_rows_give_zero(backend):
    config = FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=2)
    q, k, v = qkv(3)
    padding = torch.ones(2, SEQ)
    padding[1, :] = 0  # sample 1: every key dropped, so every row is empty
    padding[0, -5:] = 0
    attn_add = torch.randn(SEQ, SEQ)
    rpe = torch.randn(HEADS, SEQ, SEQ)
    module = SparseSelfAttention(config, key_padding_mask_mode="mul", attn_mask_mode="add", max_seq_length=SEQ,
                                 backend=backend)
    keep = (padding != 0)[:, None, None, :]
    ref = plain_attention(q, k, v, config.make_layout(SEQ), BLOCK, False, bias=attn_add + rpe, keep=keep)
    grad = backend != "flex"
    with torch.set_grad_enabled(grad):
        out = module(q, k, v, rpe=rpe, key_padding_mask=padding, attn_mask=attn_add)
    torch.testing.assert_close(out, ref.detach() if not grad else ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not out.isnan().any()
    if grad:
        grad_q, = torch.autograd.grad(out.sum(), q, retain_graph=True)
        assert not grad_q.isnan().any() and torch.equal(grad_q[1], torch.zeros_like(grad_q[1]))
        grads_close(out, ref, (q, k, v))


@pytest.mark.parametrize("backend", ["sdpa", "blocks"])
def test_add_mode_padding_and_mul_mode_attn_mask(backend):
    config = BigBirdSparsityConfig(HEADS, block=BLOCK, num_random_blocks=0)
    q, k, v = qkv(4)
    padding = torch.zeros(2, 1, 1, SEQ)  # HF's extended shape is accepted
    padding[..., -3:] = -10000.0
    causal = torch.ones(SEQ, SEQ).tril()  # "mul": zeros drop
    out = SparseSelfAttention(config, max_seq_length=SEQ, backend=backend)(q, k, v, key_padding_mask=padding,
                                                                          attn_mask=causal)
    ref = plain_attention(q, k, v, config.make_layout(SEQ), BLOCK, False, bias=padding, keep=causal.bool())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads_close(out, ref, (q, k, v))


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_blocks_per_head_masks_and_learned_bias_gradient(attention):
    """Per-head layouts with per-sample, per-head masks: each (sample, head) gathers its own mask blocks;
    a bias that wants a gradient (a learned rpe) gets the same one as through SDPA."""
    config = configs(attention, per_head=True)["bigbird"]
    q, k, v = qkv(6)
    g = torch.Generator().manual_seed(7)
    rpe = torch.randn(HEADS, SEQ, SEQ, generator=g, requires_grad=True)
    attn_mask = torch.rand(2, HEADS, SEQ, SEQ, generator=g) > 0.3  # "mul": False drops
    attn_mask[0, 1, 5] = False  # one row with nothing left
    outs = [SparseSelfAttention(config, max_seq_length=SEQ, backend=backend)(q, k, v, rpe=rpe, attn_mask=attn_mask)
            for backend in ("blocks", "sdpa")]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][0, 1, 5], torch.zeros(DIM))
    grads_close(outs[0], outs[1], (q, k, v, rpe))


def test_sequence_not_a_multiple_of_block_names_pad_to_block_size():
    module = SparseSelfAttention(FixedSparsityConfig(HEADS, block=16), max_seq_length=64)
    q = torch.randn(1, HEADS, 40, DIM)
    with pytest.raises(SparseAttentionInputError, match=r"sequence length: must be a multiple of the sparsity block "
                       r"\(16\); got 40\. Pad the inputs with SparseAttentionUtils.pad_to_block_size"):
        module(q, q, q)
    with pytest.raises(SparseAttentionInputError, match=r"at most max_seq_length \(64\) is required; got 80"):
        module(*[torch.randn(1, HEADS, 80, DIM)] * 3)
    with pytest.raises(SparseAttentionInputError, match=r"query: 2 heads \(the sparsity config's num_heads\)"):
        module(*[torch.randn(1, 3, 32, DIM)] * 3)


def test_flex_refuses_to_train_on_cpu_and_auto_trains_through_the_block_gather(monkeypatch):
    q, k, v = qkv(5)
    config = FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=2)
    with pytest.raises(ValueError, match="backend: \"flex\" cannot train on CPU"):
        SparseSelfAttention(config, max_seq_length=SEQ, backend="flex")(q, k, v)

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("the dense-mask SDPA path ran")

    monkeypatch.setattr(kernel, "sdpa_path", no_dense_mask)  # "auto" must not build the [S, S] mask
    monkeypatch.setattr(kernel, "layout_mask", no_dense_mask)
    out = SparseSelfAttention(config, max_seq_length=SEQ, backend="auto")(q, k, v)
    ref = plain_attention(q, k, v, config.make_layout(SEQ), BLOCK, False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads_close(out, ref, (q, k, v))


def test_a_flex_that_cannot_compile_falls_back_to_the_block_gather(monkeypatch, caplog):
    q, k, v = (t.detach() for t in qkv(6))
    config = BigBirdSparsityConfig(HEADS, block=BLOCK, num_random_blocks=1)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InductorError: no C++ compiler")

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("the dense-mask SDPA path ran")

    monkeypatch.setattr(kernel, "flex_path", no_compiler)
    monkeypatch.setattr(kernel, "sdpa_path", no_dense_mask)
    with caplog.at_level("WARNING", logger="shardwise"):
        out = SparseSelfAttention(config, max_seq_length=SEQ, backend="auto")(q, k, v)  # inference: flex first
    torch.testing.assert_close(out, plain_attention(q, k, v, config.make_layout(SEQ), BLOCK, False), atol=1e-5, rtol=1e-5)
    assert any("flex_attention could not run (RuntimeError: InductorError: no C++ compiler); the block gather runs "
               "instead" in m for m in caplog.messages), caplog.messages
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):  # asked for by name: no fallback
        SparseSelfAttention(config, max_seq_length=SEQ, backend="flex")(q, k, v)


def test_auto_picks_per_device_and_need_of_gradients():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernel.choose_backend("auto", cpu, grad=True) == "blocks"
    assert kernel.choose_backend("auto", cpu, grad=True, dense=True) == "sdpa"  # torch's own kernel: no [S, S]
    assert kernel.choose_backend("auto", cpu, grad=False) == "flex"
    assert kernel.choose_backend("auto", cuda, grad=True) == "flex"
    assert kernel.choose_backend("sdpa", cpu, grad=True) == "sdpa"
    assert kernel.choose_backend("blocks", cuda, grad=False) == "blocks"


def test_block_plan_groups_rows_by_width_and_shares_one_layout_across_heads():
    layout = torch.zeros(3, 8, 8, dtype=torch.long)
    layout[:, :, 0] = 1  # a global column
    layout[:, 0, :] = 1  # a global row: 8 blocks, the others 1 (row 0) or 2 (diagonal)
    layout[:, torch.arange(8), torch.arange(8)] = 1
    plan = build_plan(layout, block=2, causal=False)
    assert plan.groups == 1 and [tuple(b.key_blocks.shape) for b in plan.buckets] == [(7, 2), (1, 8)]
    assert [bucket_width(c) for c in (0, 1, 7, 8, 9, 15, 17, 33)] == [1, 1, 7, 8, 10, 16, 20, 40]
    layout[1, 3, 5] = 1
    assert build_plan(layout, block=2, causal=False).groups == 3


def _saved_bytes(fn) -> int:
    """Bytes of the storages autograd saves for the backward while `fn` runs its forward (a storage saved
    several times, as the inputs are by every chunk, counts once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_training_recomputes_chunk_by_chunk_instead_of_saving_the_gathered_blocks(monkeypatch):
    from shardwise.sparse_attention import block_gather

    q, k, v = qkv(8)
    bias = torch.randn(1, HEADS, SEQ, SEQ, requires_grad=True)
    config = BigBirdSparsityConfig(HEADS, block=BLOCK, num_random_blocks=1, attention="unidirectional")
    module = SparseSelfAttention(config, max_seq_length=SEQ, backend="blocks")
    ref = plain_attention(q, k, v, config.make_layout(SEQ), BLOCK, True, bias=bias)
    whole = _saved_bytes(lambda: module(q, k, v, rpe=bias))  # chunks of 64 MiB: one chunk per row group here
    monkeypatch.setattr(block_gather, "CHUNK_BYTES", 1)  # one query block row per chunk
    chunked = _saved_bytes(lambda: module(q, k, v, rpe=bias))
    out = module(q, k, v, rpe=bias)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads_close(out, ref, (q, k, v, bias))
    # Saved: the inputs' views and each chunk's small index tensors, not the gathered K/V and probabilities
    # (which, with every group under checkpointing, are recomputed in the backward).
    gathered = 3 * 2 * HEADS * SEQ * 5 * BLOCK * DIM * 4  # K, V and probabilities of up to 5 kept blocks per row
    assert chunked < gathered / 4, (chunked, gathered)
    assert whole < gathered / 4, (whole, gathered)
