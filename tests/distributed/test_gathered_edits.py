"""A weight edited inside `GatheredParameters(params, modifier_rank=0)` is kept at every ZeRO stage and dtype:
the modifier's values reach every rank and the fp32 masters the optimizer steps, so the next step starts from
the edit instead of writing the old master back over it. Checked against a plain fp32 torch loop that applies
the same edit between the same two steps. A partial edit changes only the edited elements of the masters: the
others keep their fp32 values rather than the 16-bit ones the parameter holds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.runtime.param_access import safe_get_full_fp32_param
from tests.harness import run_distributed

LR = 0.1
LAYOUTS = {"0": {"stage": 0}, "1": {"stage": 1}, "2": {"stage": 2}, "3": {"stage": 3},
           "2 offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},  # masters apart from the parameters
           "3 offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _edit() -> torch.Tensor:
    """The new first-layer weight: every element changes, so each rank's slice of it changes."""
    return torch.linspace(-1.0, 1.0, 128).view(16, 8)


def _oracle() -> dict[str, torch.Tensor]:
    model = _model()
    for step in range(2):
        if step == 1:
            with torch.no_grad():
                model[0].weight.copy_(_edit())
        x, y = _batch(step)
        (model(x) - y).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _edited_runs(dtype: str) -> dict[str, tuple[dict[str, torch.Tensor], bool, bool]]:
    out = {}
    for layout, zero in LAYOUTS.items():
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                  "optimizer": {"type": "SGD", "params": {"lr": LR}},
                  "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0}}
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        engine, *_ = shardwise.initialize(model=_model(), config=config)
        rank = dist.get_rank()
        for step in range(2):
            if step == 1:
                weight = engine.module[0].weight
                with shardwise.zero.GatheredParameters([weight], modifier_rank=0):
                    if rank == 0:
                        weight.data.copy_(_edit())
            x, y = (t[rank * 2 : rank * 2 + 2] for t in _batch(step))
            engine.backward((engine(x.to(_dtype(dtype))).float() - y).square().mean())
            engine.step()
        with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
            state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
        # A partial edit: the master takes the edited row; the others keep their fp32 values, not 16-bit roundings.
        weight = engine.module[2].weight
        before = safe_get_full_fp32_param(weight)
        with shardwise.zero.GatheredParameters([weight], modifier_rank=0):
            if rank == 0:
                weight.data[0] = 0.25
        after = safe_get_full_fp32_param(weight)
        out[layout] = state, torch.equal(after[0], torch.full((16,), 0.25)), torch.equal(after[1:], before[1:])
    return out


def _dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bf16" else torch.float32


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_edit_under_modifier_rank_survives_the_next_step_at_every_stage(dtype: str) -> None:
    oracle = _oracle()
    tolerance = {"fp32": 1e-5, "bf16": 2e-2}[dtype]
    results = run_distributed(_edited_runs, 2, dtype, timeout=180)
    wrong = []
    for rank, runs in enumerate(results):
        for layout, (state, row_taken, rest_kept) in runs.items():
            if not (row_taken and rest_kept):
                wrong.append(f"stage {layout} rank {rank}: edited row in the master {row_taken}, other rows' fp32 "
                             f"values kept {rest_kept}")
            for name, ref in oracle.items():
                if not torch.allclose(state[name], ref, rtol=tolerance, atol=tolerance):
                    gap = (state[name] - ref).abs().max().item()
                    wrong.append(f"stage {layout} rank {rank} {name}: off by up to {gap:.3g}")
    assert not wrong, "\n".join(wrong)
