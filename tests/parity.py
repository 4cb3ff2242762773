"""The oracle for distributed features: a plain single-process PyTorch loop with the same seed and
effective batch. Shared by the data-parallel and ZeRO parity tests.

`TinyNet` has what sharding gets wrong first: two parameter groups (decay / no decay), a frozen
parameter, a tied parameter (embedding reused as the output projection), and parameter sizes that do
not divide by 3 or 4 (padding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB, DIM, SEQ = 37, 24, 5


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.hidden = torch.nn.Linear(DIM, 3 * DIM + 1)
        self.out = torch.nn.Linear(3 * DIM + 1, DIM)
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + torch.tanh(self.frozen(x))
        x = x + self.out(F.gelu(self.hidden(x)))
        logits = self.norm(x) @ self.embed.weight.t()  # tied with the embedding
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return tokens, labels


def micro_batch(step: int, micro: int, rank: int, micro_size: int, accum: int, world: int):
    """This rank's slice of step `step`'s global batch for accumulation micro-step `micro`."""
    tokens, labels = global_batch(step, micro_size * accum * world)
    start = (micro * world + rank) * micro_size
    return tokens[start : start + micro_size], labels[start : start + micro_size]


def oracle(steps: int, batch: int, lr: float = 1e-2, clip: float = 0.0, optimizer: str = "adamw") -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole batch in one process: the losses and final parameters to match.

    SGD runs matter as much as AdamW ones: Adam normalises away a wrongly scaled gradient, SGD does not.
    """
    model = make_model()
    if optimizer == "sgd":
        opt = torch.optim.SGD(param_groups(model), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(param_groups(model), lr=lr, betas=(0.9, 0.99), eps=1e-8)
    losses = []
    for step in range(steps):
        losses.append(oracle_step(model, opt, model(*global_batch(step, batch)), clip))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def oracle_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, clip: float) -> float:
    """One plain PyTorch step on `loss` (clipped to the global norm `clip` when > 0); the loss's value."""
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return loss.item()


def ds_config(micro: int, accum: int, clip: float = 0.0, lr: float = 1e-2, optimizer: str = "adamw", **extra: Any) -> dict[str, Any]:
    opt = (
        {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}
        if optimizer == "sgd"
        else {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8}}
    )
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": opt,
        **extra,
    }


def train_steps(engine: Any, start: int, steps: int) -> list[float]:
    """Steps [start, start + steps) of the shared batch sequence; each loss is the global batch's mean."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(start, start + steps):
        total = torch.zeros((), device=engine.device)
        for m in range(accum):
            loss = engine(*(t.to(engine.device) for t in micro_batch(step, m, rank, micro, accum, world)))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (accum * world))
    return losses


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """Whole copies of the model's state, on every rank, at any stage. (At ZeRO-3 `module.state_dict()`
    returns what this rank holds, empty placeholders for partitioned parameters; inside GatheredParameters,
    entered on every rank, it holds every parameter.)"""
    import shardwise

    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def engine_run(config: dict[str, Any], steps: int) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """Train TinyNet with shardwise on this rank; return losses (mean over the global batch), params, engine.
    The batches go to the engine's device (CUDA in tests/gpu); the parameters come back on the CPU."""
    import shardwise

    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    losses = train_steps(engine, 0, steps)
    return losses, {k: v.float() for k, v in full_state_dict(engine).items()}, engine


def assert_close_run(losses, params, ref_losses, ref_params, rtol: float) -> None:
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: loss {a} vs oracle {b}"
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref.float(), rtol=rtol, atol=rtol, msg=lambda m: f"{name}: {m}")
