"""The two models of `slow_links.py`, their token batches, their ds_config, and the single-process oracle.

Shared by the parent (the oracle) and the ranks (`_slow_links_rank.py`), so that both build the same
weights from the same seed and feed the same tokens: the batch of (step, rank) is drawn from a generator
seeded by both, and the oracle's step is the world's micro-batches concatenated in rank order.

* "lora": `transformers.LlamaForCausalLM` from a local LlamaConfig (untied head) with `peft` LoRA on every
  projection, ZeRO-3 with `offload_param: {device: cpu}`: frozen weights dominate.
* "full": examples/demo/model.py's `GPT`, every parameter trained, ZeRO-3.
Both: fp32, AdamW (`_harness.ADAMW`), `gradient_clipping` 1.0, no gradient accumulation,
`stage3_max_reuse_distance` 0 (the backward gathers again, as it must for a model that does not fit).
"""

from __future__ import annotations

from typing import Any

from _harness import ADAMW

CLIP = 1.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> the model's constructor arguments, micro-batch and sequence length; --quick takes the small ones
MODELS: dict[str, dict[str, Any]] = {
    "lora": {"llama": {"vocab_size": 8000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
                       "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 256,
                       "tie_word_embeddings": False},
             "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": LORA_TARGETS},
             "micro": 2, "seq_len": 128},
    "full": {"gpt": {"preset": "demo", "d_model": 384, "n_layer": 6, "n_head": 6, "seq_len": 128},
             "micro": 2, "seq_len": 128},
}
QUICK_MODELS: dict[str, dict[str, Any]] = {
    "lora": {"llama": {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
                       "tie_word_embeddings": False},
             "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": LORA_TARGETS},
             "micro": 2, "seq_len": 32},
    "full": {"gpt": {"preset": "demo", "d_model": 96, "n_layer": 2, "n_head": 4, "seq_len": 32},
             "micro": 2, "seq_len": 32},
}


def build(spec: dict[str, Any]) -> tuple[Any, list[Any]]:
    """(model, parameter groups for the optimizer) for `spec["model"]`, seeded by `spec["seed"]`."""
    import torch

    torch.manual_seed(spec["seed"])
    if "llama" in spec["model"]:
        import peft
        import transformers

        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec["model"]["llama"]))
        model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **spec["model"]["lora"]))
        return model, [{"params": [p for p in model.parameters() if p.requires_grad]}]
    from examples.demo.model import GPT, preset

    gpt = dict(spec["model"]["gpt"])
    model = GPT(preset(gpt.pop("preset"), **gpt))
    return model, model.param_groups()


def vocab(spec: dict[str, Any]) -> int:
    return spec["model"]["llama"]["vocab_size"] if "llama" in spec["model"] else 256


def batch(spec: dict[str, Any], step: int, rank: int) -> Any:
    """Rank `rank`'s tokens at step `step`: (micro, seq_len + 1), the same in every process."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step * 1_009 + rank)
    return torch.randint(0, vocab(spec), (spec["model"]["micro"], spec["model"]["seq_len"] + 1), generator=g)


def loss_of(model: Any, tokens: Any, llama: bool) -> Any:
    """Mean next-token cross-entropy over every position (equal-size micro-batches: the mean of the ranks' means)."""
    if llama:
        return model(input_ids=tokens, labels=tokens).loss  # the model shifts the labels itself
    return model(tokens[:, :-1], tokens[:, 1:])


def ds_config(spec: dict[str, Any]) -> dict[str, Any]:
    """slow_links' config (ZeRO-3, AdamW), whose top-level keys `spec["config"]` replaces where it has them."""
    # Release each module's weights after use, as a model too large to stay gathered must (the 14B case):
    # at the default reuse distance these small models stay gathered from forward to backward.
    zero: dict[str, Any] = {"stage": 3, "stage3_max_reuse_distance": 0}
    if "llama" in spec["model"]:
        zero["offload_param"] = {"device": "cpu"}
    zero.update(spec["zero"])
    config = {"train_micro_batch_size_per_gpu": spec["model"]["micro"], "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": ADAMW}, "zero_optimization": zero}
    return {**config, **spec.get("config", {})}  # onebit.py's runs: their own optimizer, stage and precision


def parameter_counts(spec: dict[str, Any]) -> dict[str, int]:
    import torch

    with torch.device("meta"):
        model, groups = build(spec)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for g in groups for p in g["params"])}


def oracle_losses(spec: dict[str, Any], world: int, steps: int) -> list[float]:
    """Losses of one process training on the world's micro-batches concatenated: plain torch AdamW, the
    same clipping (global norm over the trained parameters)."""
    import torch

    torch.set_num_threads(1)
    model, groups = build(spec)
    trained = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"])
    losses = []
    for step in range(steps):
        tokens = torch.cat([batch(spec, step, r) for r in range(world)])
        loss = loss_of(model, tokens, "llama" in spec["model"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
