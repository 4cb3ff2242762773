"""Tiny Hugging Face models (built locally) and random-LTD configs for the random-LTD tests, and the hand-written
oracle: the same model run layer by layer, each random-LTD layer applied to one sample's kept tokens at a time."""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ, LAYERS = 64, 12, 4


def tiny(kind: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4,
                                      attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(cfg)
    model.set_attn_implementation(attn)
    return model.train()


def ltd_section(layer_ids: list[int], min_value: int, max_value: int, require_steps: int = 4, seq_per_step: int = 2,
                **extra: Any) -> dict[str, Any]:
    """The config's data_efficiency section with random-LTD on."""
    schedule = {"min_value": min_value, "max_value": max_value, "schedule_type": "fixed_linear",
                "schedule_config": {"require_steps": require_steps, "seq_per_step": seq_per_step}}
    ltd = {"enabled": True, "random_ltd_layer_id": layer_ids, "random_ltd_layer_num": len(layer_ids),
           "random_ltd_schedule": schedule, **extra}
    return {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}}


def batch(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(step))


def oracle_loss(kind: str, model: torch.nn.Module, ids: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """The causal-LM loss with layer i run on sample b's positions kept[i][b] only (one sample at a time, causal
    mask built for the kept tokens), its output written back at those positions; other layers run whole."""
    base = model.transformer if kind == "gpt2" else model.model
    layers = base.h if kind == "gpt2" else base.layers
    positions = torch.arange(ids.shape[1])[None]
    h = base.wte(ids) + base.wpe(positions) if kind == "gpt2" else base.embed_tokens(ids)
    for i, layer in enumerate(layers):
        run = type(layer).forward  # the class's forward: the layer as Hugging Face wrote it
        index = kept.get(i, positions.expand(ids.shape[0], -1))
        rows = []
        for b in range(ids.shape[0]):
            x = h[b:b + 1, index[b]]
            mask = _causal(index.shape[1]) if model.config._attn_implementation == "eager" else None
            if kind == "gpt2":
                y = run(layer, x, attention_mask=mask)
            else:
                y = run(layer, x, attention_mask=mask, position_embeddings=base.rotary_emb(x, index[b:b + 1]))
            rows.append(h[b].index_copy(0, index[b], y[0]))
        h = torch.stack(rows)
    h = base.ln_f(h) if kind == "gpt2" else base.norm(h)
    logits = model.lm_head(h)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _causal(k: int) -> torch.Tensor:
    return torch.full((k, k), torch.finfo(torch.float32).min).triu(1)[None, None]
