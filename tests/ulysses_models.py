"""A tiny LLaMA with grouped-query attention for the Ulysses tests, its single-process full-sequence oracle and
the rank-side loop.

Rank r's own loader yields sample `r + world × i` at its i-th batch (one sample per batch). The loader adapter
turns one batch per rank into `sp` iterations of the whole sequence group: at step t, sequence group g trains on
the sample of its member `g × sp + t % sp`, read at that member's batch `t // sp`. The oracle's step t is the
mean over the groups of each group's per-token mean loss, which is what averaging the gradients over the data
group computes. Labels are -100 over a prompt whose length varies by sample, so the slices of one sequence hold
different numbers of unmasked tokens, and some slices none.
"""

from __future__ import annotations

import os
from typing import Any

import torch

VOCAB, SEQ, STEPS = 96, 16, 4
LR, MOMENTUM, CLIP = 0.1, 0.9, 0.05
PROMPTS = [0, 9, 3, 12, 5, 1, 10, 7]
"""Masked prompt length per sample: 9 and 12 leave a whole first slice (of 8 or 4 tokens) with no label at sp 2
or 4."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build(lora: bool = False, heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=64, attn_implementation="sdpa"))
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                           lora_dropout=0.0, init_lora_weights=False))
    return model


def sample(index: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1000 + index))
    labels = ids.clone()
    labels[:, : PROMPTS[index % len(PROMPTS)]] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ).unsqueeze(0),
            "attention_mask": torch.ones(1, SEQ, dtype=torch.long)}


def group_sample(step: int, group: int, sp: int, world: int) -> int:
    member = group * sp + step % sp
    return member + world * (step // sp)


def schedule(sp: int, world: int, steps: int = STEPS) -> list[list[int]]:
    """Each step's sample per sequence group."""
    return [[group_sample(step, g, sp, world) for g in range(world // sp)] for step in range(steps)]


def oracle(sp: int, world: int, lora: bool = False, steps: int = STEPS, plan: list[list[int]] | None = None) -> dict[str, Any]:
    """Every group's whole sequence in one process (`plan`: each step's sample per group, by default the
    layout's): per-group losses per step, gradient norms, final weights."""
    model = build(lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for indices in plan or schedule(sp, world, steps):
        per_group = []
        for index in indices:
            batch = sample(index)
            per_group.append(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
        torch.stack(per_group).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trained, CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append([loss.item() for loss in per_group])
    assert min(norms) > CLIP, f"the clip must act at every step for the test to check the norm; norms {norms}"
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}}


def config(sp: int, stage: int, tp: int = 1, **extra: Any) -> dict[str, Any]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "sequence_parallel_size": sp,
            "gradient_clipping": CLIP, "steps_per_print": 1000, "zero_optimization": {**zero, **extra.pop("zero", {})},
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}), **extra}


def run_case(sp: int, stage: int = 0, lora: bool = False, checkpointing: bool = False, steps: int = STEPS,
             save: str | None = None, load: str | None = None, tp: int = 1, **extra: Any) -> dict[str, Any]:
    """On each rank: build, initialize with `sequence_parallel_size` sp (beside `tp` tensor-parallel ranks, which
    read the same data), train on the adapter's slices."""
    import shardwise
    from shardwise.sequence_parallel import SequenceShardLoader, combine_loss, recorded_link
    from tests.parity import full_state_dict
    from tests.tensor_parallel_models import whole_params

    rank, world = int(os.environ["RANK"]) // tp, int(os.environ["WORLD_SIZE"]) // tp  # data ranks
    model = build(lora)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = shardwise.initialize(model=model, config=config(sp, stage, tp, **extra))
    if load is not None:
        engine.load_checkpoint(load)
    link = recorded_link() if sp > 1 else None
    own = [sample(rank + world * i) for i in range((steps + sp - 1) // sp)]
    losses, norms = [], []
    for step, batch in zip(range(steps), SequenceShardLoader(own, link) if link else own):
        if link is None:  # one rank per sequence: the model shifts the labels itself
            loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        else:
            labels = batch["shift_labels"]
            out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels,
                         shift_labels=labels)
            loss = combine_loss(out.loss, labels, link)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    if save is not None:
        engine.save_checkpoint(save)
    state = whole_params(engine) if tp > 1 else full_state_dict(engine)
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    return {"losses": losses, "norms": norms, "group": rank // sp, "exchanges": link.exchanges if link else 0,
            "counted_all_to_alls": engine.comm.stats.calls("all_to_all", "sequence"),
            "params": {n: v.float() for n, v in state.items() if n in trained}}


def assert_matches(got: dict[str, Any], ref: dict[str, Any], rtol: float = 1e-5, label: str = "") -> None:
    for step, (a, want) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        b = want[got["group"]]
        assert abs(a - b) <= rtol * abs(b), f"{label} step {step}: loss {a} vs oracle {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{label} step {step}: gradient norm {a} vs oracle {b}"
    assert set(got["params"]) == set(ref["params"]), label
    for name, value in ref["params"].items():
        error = (got["params"][name] - value).abs().max().item()
        assert error <= rtol * value.abs().max().item() + 1e-7, f"{label} {name}: off by {error}"
