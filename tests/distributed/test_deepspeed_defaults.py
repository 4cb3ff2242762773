"""DeepSpeed's defaults, checked by what the engine does (not by reading the parsed config): a config that does
not set `gradient_clipping` clips the global gradient norm at 1.0; optimizer "Adam" is AdamW (decoupled weight
decay) unless `adam_w_mode: false`; weight decay defaults to 0 (torch's AdamW defaults to 0.01). The oracle is
plain torch on the whole batch in one process."""

from __future__ import annotations

from typing import Any, Callable

import torch

import shardwise
from tests.harness import run_distributed
from tests.parity import assert_close_run, full_state_dict, global_batch, make_model, train_steps

STEPS, WORLD, MICRO, LR = 5, 2, 2, 0.05
CASES: dict[str, dict[str, Any]] = {  # optimizer params as a DeepSpeed config writes them (no clipping key)
    "Adam": {"lr": LR},
    "Adam+weight_decay": {"lr": LR, "weight_decay": 0.1},
    "Adam+weight_decay, adam_w_mode false": {"lr": LR, "weight_decay": 0.1, "adam_w_mode": False},
}


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _oracle(make_optimizer: Callable[[list], torch.optim.Optimizer], clip: float | None):
    model = make_model()
    optimizer = make_optimizer(_trainable(model))
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(step, MICRO * WORLD))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(_trainable(model), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_runs(stage: int):
    out = {}
    for name, params in CASES.items():
        model = make_model()
        config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "Adam", "params": params},
                  "zero_optimization": {"stage": stage}}
        engine, *_ = shardwise.initialize(model=model, model_parameters=_trainable(model), config=config)
        losses = train_steps(engine, 0, STEPS)
        out[name] = (losses, {k: v.float() for k, v in full_state_dict(engine).items()})
    return out


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_gradient_clipping_adam_and_weight_decay_defaults():
    decoupled = lambda wd: lambda p: torch.optim.AdamW(p, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    coupled = lambda wd: lambda p: torch.optim.Adam(p, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    expected = {"Adam": _oracle(decoupled(0.0), clip=1.0),
                "Adam+weight_decay": _oracle(decoupled(0.1), clip=1.0),
                "Adam+weight_decay, adam_w_mode false": _oracle(coupled(0.1), clip=1.0)}
    # The test tells the defaults apart: each wrong reading moves the weights by far more than the tolerance.
    assert _differs(_oracle(decoupled(0.0), clip=None)[1], expected["Adam"][1]) > 1e-2  # no clipping
    assert _differs(_oracle(decoupled(0.01), clip=1.0)[1], expected["Adam"][1]) > 1e-4  # torch's default decay
    assert _differs(_oracle(coupled(0.1), clip=1.0)[1], expected["Adam+weight_decay"][1]) > 1e-3  # L2, not AdamW
    for stage in (0, 2):
        got = run_distributed(_engine_runs, WORLD, stage, timeout=180)[0]
        for name, (ref_losses, ref_params) in expected.items():
            losses, params = got[name]
            # fp32, the same arithmetic up to the order of the gradient reduction.
            assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)
