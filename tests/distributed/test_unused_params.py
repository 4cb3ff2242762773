"""A parameter that some micro-steps do not reach: its gradient counts as zero, never as a stale value
(a gradient buffer that were not cleared between steps would show here), at every ZeRO stage.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from tests.harness import run_distributed
from tests.parity import DIM, VOCAB, TinyNet, assert_close_run, ds_config, full_state_dict, global_batch, param_groups

STEPS, MICRO, ACCUM = 6, 2, 2


class SometimesNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(DIM, DIM)
        self.use_extra = True

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.use_extra:
            x = x + torch.tanh(self.extra(x))
        x = x + self.out(F.gelu(self.hidden(x)))
        logits = self.norm(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _used(step: int, micro: int) -> bool:
    return (step + micro) % 3 == 0  # both micro-steps, one, or none of a step reach `extra`


def _model() -> SometimesNet:
    torch.manual_seed(0)
    return SometimesNet()


def _oracle(world: int):
    model = _model()
    opt = torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        tokens, labels = global_batch(step, MICRO * ACCUM * world)
        total = 0.0
        for m in range(ACCUM):
            model.use_extra = _used(step, m)
            part = slice(m * world * MICRO, (m + 1) * world * MICRO)
            loss = model(tokens[part], labels[part])
            (loss / ACCUM).backward()
            total += loss.item()
        for p in model.parameters():  # a parameter no micro-step reached steps on a zero gradient
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / ACCUM)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_run(stage: int):
    model = _model()
    config = ds_config(MICRO, ACCUM, lr=0.1, optimizer="sgd", zero_optimization={"stage": stage})
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        tokens, labels = global_batch(step, MICRO * ACCUM * world)
        total = torch.zeros(())
        for m in range(ACCUM):
            model.use_extra = _used(step, m)
            start = (m * world + rank) * MICRO
            loss = engine(tokens[start : start + MICRO], labels[start : start + MICRO])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (ACCUM * world))
    return losses, {k: v.float() for k, v in full_state_dict(engine).items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameter_unused_in_some_micro_steps_matches_oracle(stage):
    losses, params = run_distributed(_engine_run, 2, stage)[0]
    ref_losses, ref_params = _oracle(2)
    assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)
