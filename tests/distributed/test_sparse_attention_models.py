"""Tiny GPT-2 and LLaMA trained through `shardwise.initialize` with a `sparse_attention` section (2 ranks,
stage 0) agree with a single-process oracle: dense mode with the model's own SDPA attention, fixed mode
with an attention function written here that masks plain scores with the expanded layout. A tiny BERT is
switched with SparseAttentionUtils and checked the same way."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import run_distributed
from tests.inference_models import VOCAB, build

WORLD, MICRO, SEQ, STEPS, LR = 2, 2, 32, 3, 0.5
FIXED = {"mode": "fixed", "block": 4, "num_local_blocks": 2, "attention": "unidirectional"}


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (WORLD * MICRO, SEQ), generator=g) for _ in range(STEPS)]


def _steps(engine, ids: list[torch.Tensor]) -> list[float]:
    rank, losses = torch.distributed.get_rank(), []
    for batch in ids:
        mine = batch[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train(rank_model_kind: str, section: dict) -> list[float]:
    import shardwise

    model = build(rank_model_kind).train()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "sparse_attention": section,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    assert model.config._attn_implementation.startswith("shardwise_sparse_")
    return _steps(engine, batches())


def masked_attention(layout: torch.Tensor, block: int):
    """Oracle attention for a HF model: every score, then the layout (expanded to tokens) and causality."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        seq = query.shape[2]
        allowed = layout[:, :seq // block, :seq // block].bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = (query @ key.transpose(-1, -2)) * scaling
        probs = torch.softmax(scores.masked_fill(~allowed, -float("inf")), dim=-1)
        return (probs @ value).transpose(1, 2).contiguous(), None

    return attend


def oracle(kind: str, attention: str | None) -> list[float]:
    model = build(kind).train()
    if attention is not None:
        model.set_attn_implementation(attention)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in batches():
        per_rank = [model(input_ids=ids[r * MICRO:(r + 1) * MICRO], labels=ids[r * MICRO:(r + 1) * MICRO]).loss
                    for r in range(WORLD)]
        optimizer.zero_grad()
        (sum(per_rank) / WORLD).backward()  # the data-parallel mean of the ranks' gradients
        optimizer.step()
        losses.append([loss.item() for loss in per_rank])
    return losses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_dense_mode_trains_like_sdpa_and_fixed_like_an_explicit_mask(kind):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from shardwise.sparse_attention import FixedSparsityConfig

    dense = run_distributed(_train, WORLD, kind, {"mode": "dense"})
    want = oracle(kind, None)
    for rank in range(WORLD):
        torch.testing.assert_close([step[rank] for step in want], dense[rank], atol=1e-5, rtol=1e-5)

    heads = build(kind).config.num_attention_heads
    layout = FixedSparsityConfig(heads, block=4, num_local_blocks=2, attention="unidirectional").make_layout(64)
    AttentionInterface.register("test_layout_mask", masked_attention(layout, 4))
    ALL_MASK_ATTENTION_FUNCTIONS.register("test_layout_mask", sdpa_mask)
    fixed = run_distributed(_train, WORLD, kind, FIXED)
    want_fixed = oracle(kind, "test_layout_mask")
    for rank in range(WORLD):
        torch.testing.assert_close([step[rank] for step in want_fixed], fixed[rank], atol=1e-5, rtol=1e-5)
    assert abs(fixed[0][0] - dense[0][0]) > 1e-4  # the layout changes what is computed
    assert fixed[0][-1] < fixed[0][0]  # and it trains


def test_bidirectional_layout_on_a_causal_model_is_refused():
    import shardwise.sparse_attention as sa

    with pytest.raises(sa.hf.SparseModelError, match="sparse_attention.attention: \"unidirectional\" is required for "
                       "GPT2LMHeadModel, a causal model; got 'bidirectional'"):
        sa.SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
            build("gpt2"), 64, sa.FixedSparsityConfig(4, block=4))


def test_bert_through_replace_model_self_attention_and_padding():
    import transformers

    from shardwise.sparse_attention import BigBirdSparsityConfig, SparseAttentionUtils

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, attention_probs_dropout_prob=0.0,
                                     hidden_dropout_prob=0.0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, BigBirdSparsityConfig(4, block=8, num_random_blocks=0, num_sliding_window_blocks=7))
    assert model.config._attn_implementation.startswith("shardwise_sparse_")
    ids = torch.randint(3, VOCAB, (2, 27))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    pad_len, ids_p, mask_p, *_ = SparseAttentionUtils.pad_to_block_size(8, ids, mask, None, None, None, 0, None)
    assert (pad_len, ids_p.shape[1], int(mask_p[0].sum())) == (5, 32, 27)
    with torch.enable_grad():
        out = model(input_ids=ids_p, attention_mask=mask_p).last_hidden_state
    out = SparseAttentionUtils.unpad_sequence_output(pad_len, out)
    want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[0], want[0], atol=1e-5, rtol=1e-5)  # a window over everything: dense
    torch.testing.assert_close(out[1, :20], want[1, :20], atol=1e-5, rtol=1e-5)
    SparseAttentionUtils.extend_position_embedding(model, 128)
    assert model.embeddings.position_embeddings.weight.shape[0] == 128
    assert torch.equal(model.embeddings.position_embeddings.weight[64:], model.embeddings.position_embeddings.weight[:64])


BIGBIRD = {"mode": "bigbird", "block": 4, "num_random_blocks": 1, "num_sliding_window_blocks": 3,
           "num_global_blocks": 1, "attention": "unidirectional"}


def _sparse_engine(stage: int, seed: int = 0):
    import shardwise

    model = build("llama").train()  # seeded by build itself
    torch.manual_seed(seed)  # the global RNG state initialize (and the layout) sees
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "sparse_attention": BIGBIRD,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    return engine


def _weights(engine) -> dict[str, torch.Tensor]:
    from shardwise.runtime.param_access import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _whole_and_saved(root: str):
    ids = batches()
    whole = _sparse_engine(3)
    whole_losses = _steps(whole, ids)
    first = _sparse_engine(3)
    losses = _steps(first, ids[:1])
    first.save_checkpoint(root)
    return whole_losses, losses, _weights(whole)


def _resumed(root: str):
    # New processes in another global RNG state: the layout's random blocks must come from the section's seed
    # (in one process the sparse kernel, registered with transformers by config, would be shared).
    resumed = _sparse_engine(3, seed=123)
    resumed.load_checkpoint(root)
    return _steps(resumed, batches()[1:]), _weights(resumed)


def test_a_sparse_run_resumes_exactly(tmp_path):
    whole_losses, losses, whole = run_distributed(_whole_and_saved, WORLD, str(tmp_path), timeout=300)[0]
    later, resumed = run_distributed(_resumed, WORLD, str(tmp_path), timeout=300)[0]
    assert losses + later == whole_losses  # bit for bit
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
