"""Tiny Hugging Face models for the tensor-parallel tests, their single-process oracle and the rank-side loop.

Every model is built after `torch.manual_seed(0)`, so a rank's whole model (split at `initialize`) and the
oracle's start from the same weights. Each step trains on a global batch of `GLOBAL` sequences; a rank takes
its data-parallel slice. The optimizer is SGD with momentum: Adam normalises away a wrongly scaled gradient,
SGD does not; and the clip is below every step's gradient norm, so a norm that miscounts split or replicated
parameters changes the update.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch

from tests.parity import full_state_dict

VOCAB, SEQ, GLOBAL, STEPS = 64, 12, 4, 3
LR, MOMENTUM, CLIP = 0.2, 0.9, 0.1
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


class MegatronNet(torch.nn.Module):
    """A model of shardwise's Megatron-style layers (no plan: each layer declares how it is split)."""

    def __init__(self) -> None:
        from shardwise.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, 16)
        self.up, self.down = ColumnParallelLinear(16, 32), RowParallelLinear(32, 16)
        self.head = ColumnParallelLinear(16, VOCAB, bias=False, gather_output=True)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids)
        logits = self.head(x + self.down(torch.nn.functional.gelu(self.up(x))))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def build(kind: str, tie: bool = False, lora: bool = False) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "megatron":
        return MegatronNet()
    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    if kind == "gpt2":  # fused q/k/v (c_attn, 3 blocks), Conv1D, tied head
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    elif kind == "opt":  # biases everywhere, learned positions, tied head
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **small))
    elif kind == "bert":  # post-norm encoder, tied decoder with its own bias
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small))
    elif kind in ("qwen2", "qwen3"):  # qwen2: q/k/v biases; qwen3: per-head q/k norms (gradients summed)
        config_class = transformers.Qwen2Config if kind == "qwen2" else transformers.Qwen3Config
        model = transformers.AutoModelForCausalLM.from_config(config_class(
            intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=tie, head_dim=8, **small))
    else:  # llama, grouped-query attention
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=tie, **small))
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=LORA_TARGETS))
    return model


def batch(step: int, fixed: bool = False) -> torch.Tensor:
    """Step `step`'s global batch; `fixed`: step 0's at every step (random tokens are learnable only by
    memorising them, so the loss falls far enough to show a precision's drift)."""
    step = 0 if fixed else step
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(100 + step))


def loss_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def oracle(kind: str, tie: bool = False, lora: bool = False, steps: int = STEPS, fixed: bool = False,
           lr: float = LR) -> dict[str, Any]:
    """The whole batch in one process: losses, pre-clip gradient norms and final parameters."""
    model = build(kind, tie, lora)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=MOMENTUM)
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(model, batch(step, fixed))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())  # the norm before clipping
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert min(norms) > CLIP, f"the clip must act at every step for the test to check the norm; norms {norms}"
    return {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def config(tp: int, dp: int, stage: int = 0, lr: float = LR, **extra: Any) -> dict[str, Any]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {"train_micro_batch_size_per_gpu": GLOBAL // dp, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 1000, "zero_optimization": zero,
            "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": MOMENTUM}},
            **extra, "tensor_parallel": {"autotp_size": tp, **extra.get("tensor_parallel", {})}}


def train(engine: Any, steps: int = STEPS, start: int = 0, fixed: bool = False) -> dict[str, list[float]]:
    """Steps [start, start + steps) on this rank's data-parallel slice; each loss is the global batch's mean."""
    import torch.distributed as dist

    dp_rank, dp = engine.topology.data.rank, engine.topology.data.size
    micro = GLOBAL // dp
    losses, norms = [], []
    for step in range(start, start + steps):
        ids = batch(step, fixed)[dp_rank * micro : (dp_rank + 1) * micro].to(engine.device)
        loss = loss_of(engine, ids)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)  # tensor-parallel ranks hold the same loss: the mean over the world is the dp mean
        losses.append(total.item() / dist.get_world_size())
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "norms": norms}


def whole_params(engine: Any) -> dict[str, torch.Tensor]:
    """The model's whole parameters on every rank: gathered over data-parallel ranks (ZeRO-3), then the
    tensor-parallel parts assembled; keyed as the single-process model's state_dict (tied names included)."""
    import torch.distributed as dist

    from shardwise.tensor_parallel import assemble

    state = full_state_dict(engine)
    canonical = {id(p): n for n, p in engine.module.named_parameters()}
    alias = {n: canonical[id(p)] for n, p in engine.module.named_parameters(remove_duplicate=False)}
    out = {}
    for name, value in state.items():
        shard = engine.tensor_shards.get(alias.get(name, name))
        if shard is not None:
            parts = [torch.empty_like(value) for _ in range(shard.size)]
            dist.all_gather(parts, value.contiguous(), group=engine.tensor_parallel.link.group.pg)
            value = assemble(parts, shard.dim, shard.blocks)
        out[name] = value.float()
    return out


def run_case(kind: str, tie: bool, tp: int, stage: int = 0, lora: bool = False, steps: int = STEPS,
             fixed: bool = False, lr: float = LR, **extra: Any) -> dict[str, Any]:
    """On each rank: build, initialize at `tp` x (world / tp), train; losses, norms, whole parameters."""
    import shardwise

    model = build(kind, tie, lora)
    dp = int(os.environ["WORLD_SIZE"]) // tp
    engine, *_ = shardwise.initialize(model=model, config=config(tp, dp, stage, lr, **extra))
    result = train(engine, steps, fixed=fixed)
    result["params"] = whole_params(engine)
    result["local_shapes"] = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    result["shards"] = dict(engine.tensor_shards)
    return result


def assert_matches(got: dict[str, Any], ref: dict[str, Any], rtol: float = 1e-5, label: str = "") -> None:
    """Losses and gradient norms within `rtol` relative; each parameter within `rtol` of its tensor's scale (plus
    1e-7 absolute, for tensors that stay near zero: OPT's key biases get no gradient, softmax ignores them)."""
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{label} step {i}: loss {a} vs oracle {b}"
    for i, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{label} step {i}: gradient norm {a} vs oracle {b}"
    assert set(got["params"]) == set(ref["params"]), label
    for name, value in ref["params"].items():
        error = (got["params"][name] - value.float()).abs().max().item()
        assert error <= rtol * value.abs().max().item() + 1e-7, f"{label} {name}: off by {error}"
