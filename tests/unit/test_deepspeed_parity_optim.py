"""Our schedulers and Lamb against DeepSpeed's own, when DeepSpeed is installed.

DeepSpeed is a reference here, never a dependency: without it these tests skip (tests/reference.py).
`make test-deepspeed` runs them against deepspeed==0.19.8, as .ci/run does.

The schedulers are plain Python in DeepSpeed and are compared on CPU. DeepSpeed's FusedLamb is a
CUDA kernel, so the Lamb comparison runs only where CUDA is present and the op builds.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.reference import real_deepspeed

os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
real_deepspeed()  # skips in shardwise's own venv; `make test-deepspeed` runs this module against DeepSpeed
import deepspeed.runtime.lr_schedules as ds_schedules  # noqa: E402

from shardwise.optim.lamb import Lamb  # noqa: E402
from shardwise.optim.schedulers import SCHEDULERS  # noqa: E402

TOL = 1e-7
STEPS = 30

CASES = [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10)),
    ("WarmupLR", dict(warmup_num_steps=7, warmup_type="linear")),  # peak from the optimizer's lr
    ("WarmupLR", dict(warmup_min_lr=[0.0, 0.002], warmup_max_lr=[0.01, 0.02], warmup_num_steps=1)),
    ("WarmupDecayLR", dict(total_num_steps=25, warmup_num_steps=10)),
    ("WarmupDecayLR", dict(total_num_steps=20, warmup_max_lr=0.05, warmup_num_steps=6, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=4, warmup_num_steps=8)),  # total < warmup
    ("WarmupCosineLR", dict(total_num_steps=25, warmup_num_steps=10, warmup_min_ratio=0.1)),
    ("WarmupCosineLR", dict(total_num_steps=18, warmup_num_steps=5, cos_min_ratio=0.02, warmup_type="linear")),
    ("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=6)),
    ("OneCycle", dict(cycle_min_lr=[0.001, 0.002], cycle_max_lr=[0.01, 0.03], cycle_first_step_size=5,
                      cycle_second_step_size=7, decay_step_size=3, decay_lr_rate=0.5, decay_mom_rate=0.1,
                      cycle_min_mom=[0.85, 0.8], cycle_max_mom=0.95)),
    ("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=6, cycle_second_step_size=9,
                      cycle_first_stair_count=3, cycle_second_stair_count=2, decay_step_size=2,
                      decay_lr_rate=0.2)),
    ("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=4, cycle_second_step_size=0,
                      cycle_momentum=False)),
    ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=4, lr_range_test_step_rate=2.0)),
    ("LRRangeTest", dict(lr_range_test_min_lr=[0.001, 0.01], lr_range_test_step_size=3,
                         lr_range_test_staircase=True)),
]  # fmt: skip


def two_group_adam() -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(3))]}]
    return torch.optim.Adam(groups, lr=0.02, betas=(0.9, 0.999))


def groups_view(opt: torch.optim.Optimizer) -> list[tuple[float, tuple[float, float]]]:
    return [(float(g["lr"]), tuple(g["betas"])) for g in opt.param_groups]


def assert_same_groups(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, where: str) -> None:
    for (lr, betas), (ds_lr, ds_betas) in zip(groups_view(ours), groups_view(theirs)):
        assert lr == pytest.approx(ds_lr, abs=TOL, rel=0), f"lr {where}"
        assert betas == pytest.approx(ds_betas, abs=TOL, rel=0), f"betas {where}"


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_scheduler_lr_sequence_matches_deepspeed(name, params):
    ours_opt, ds_opt = two_group_adam(), two_group_adam()
    ours = SCHEDULERS[name](ours_opt, **params)
    theirs = getattr(ds_schedules, name)(ds_opt, **params)
    assert_same_groups(ours_opt, ds_opt, "after construction")
    for step in range(STEPS):
        ours.step()
        theirs.step()
        assert_same_groups(ours_opt, ds_opt, f"after step {step}")
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), abs=TOL, rel=0)
        assert ours.get_lr() == pytest.approx(theirs.get_lr(), abs=TOL, rel=0)
    assert ours.state_dict() == theirs.state_dict()
    # Explicit iterations (jumps, going back) as engine.step(lr_kwargs=...) can pass them.
    for k in (3, 17, 0, 45, 8):
        ours.step(k)
        theirs.step(k)
        assert_same_groups(ours_opt, ds_opt, f"at explicit iteration {k}")


@pytest.mark.parametrize("name,params", CASES[::3], ids=[n for n, _ in CASES[::3]])
def test_resume_from_deepspeed_state_dict(name, params):
    ds_opt = two_group_adam()
    theirs = getattr(ds_schedules, name)(ds_opt, **params)
    for _ in range(11):
        theirs.step()
    ours_opt = two_group_adam()
    ours = SCHEDULERS[name](ours_opt, **params, last_batch_iteration=5)
    ours.load_state_dict(theirs.state_dict())
    for step in range(10):
        ours.step()
        theirs.step()
        assert_same_groups(ours_opt, ds_opt, f"after resumed step {step}")


def test_tensor_lr_matches_deepspeed():
    def sgd():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.05))

    ours_opt, ds_opt = sgd(), sgd()
    ours = SCHEDULERS["WarmupCosineLR"](ours_opt, total_num_steps=12, warmup_num_steps=4)
    theirs = ds_schedules.WarmupCosineLR(ds_opt, total_num_steps=12, warmup_num_steps=4)
    for _ in range(15):
        ours.step()
        theirs.step()
        assert ours_opt.param_groups[0]["lr"].item() == pytest.approx(ds_opt.param_groups[0]["lr"].item(), abs=TOL)


# ---- Lamb -------------------------------------------------------------------------------------


def _deepspeed_fused_lamb():
    if not torch.cuda.is_available():
        pytest.skip("DeepSpeed's FusedLamb is a CUDA-only kernel and there is no CUDA device here")
    try:
        from deepspeed.ops.lamb import FusedLamb

        probe = FusedLamb([torch.nn.Parameter(torch.zeros(1, device="cuda"))])
    except Exception as e:  # noqa: BLE001 - any build/load failure means: no reference available
        pytest.skip(f"DeepSpeed's FusedLamb op could not be built or loaded here: {e}")
    del probe
    return FusedLamb


LAMB_CASES = {
    "defaults": dict(),
    "weight_decay_and_bias_correction_off": dict(lr=0.01, weight_decay=0.05, bias_correction=False),
    "eps_inside_sqrt_and_clamps": dict(lr=0.01, eps=1e-4, eps_inside_sqrt=True, max_coeff=0.5, min_coeff=0.2),
}


@pytest.mark.parametrize("name", LAMB_CASES)
def test_lamb_updates_match_deepspeed_fused_lamb(name):
    fused_lamb = _deepspeed_fused_lamb()
    kw = LAMB_CASES[name]
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (1000,), (3, 4, 2)]
    # Small weights: an update is read as p_new - p_old, which carries one fp32 ulp of p; at |p| < 1
    # that noise (<= 6e-8) stays under the 1e-7 tolerance, while the update itself is ~1e-3.
    init = [0.1 * torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    ours_p = [torch.nn.Parameter(t.clone().cuda()) for t in init]
    ds_p = [torch.nn.Parameter(t.clone().cuda()) for t in init]
    ours, theirs = Lamb(ours_p, **kw), fused_lamb(ds_p, **kw)
    for step, step_grads in enumerate(grads):
        before = [p.detach().clone() for p in ours_p]
        for a, b, g in zip(ours_p, ds_p, step_grads):
            a.grad, b.grad = g.cuda(), g.cuda()
        ours.step()
        theirs.step()
        for i, (a, b, prev) in enumerate(zip(ours_p, ds_p, before)):
            torch.testing.assert_close(a - prev, b - prev, atol=TOL, rtol=0, msg=f"update of tensor {i}, step {step}")
        assert ours.get_lamb_coeffs() == pytest.approx(theirs.get_lamb_coeffs(), rel=1e-6)
