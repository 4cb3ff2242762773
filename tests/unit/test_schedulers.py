"""The DeepSpeed-compatible lr schedulers against their closed forms.

Expected values are worked out by hand from DeepSpeed's formulas and written here as numbers (or
as arithmetic on literal constants), never computed by the code under test. ``k`` below is
``last_batch_iteration``: the value after the (k+1)-th ``step()``.
"""

from __future__ import annotations

import re

import pytest
import torch

from shardwise.optim.schedulers import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

LOG10_2 = 0.30102999566398120  # log(2) / log(10)
LOG10_5 = 0.69897000433601886  # log(5) / log(10)
COS_PI_8 = 0.92387953251128674  # cos(pi / 8)


def adam(lr: float = 0.01, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)], lr=lr)


def lr_at(scheduler, k: int) -> float:
    """The lr of group 0 after stepping straight to batch k (steps may jump, as in DeepSpeed)."""
    scheduler.step(k)
    return scheduler.optimizer.param_groups[0]["lr"]


def lrs_by_stepping(scheduler, n: int) -> list[float]:
    out = []
    for _ in range(n):
        scheduler.step()
        out.append(scheduler.optimizer.param_groups[0]["lr"])
    return out


# ---- WarmupLR ---------------------------------------------------------------------------------


def test_warmup_log_starts_at_min_and_reaches_max_at_last_warmup_step():
    opt = adam()
    s = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.01  # construction writes the min lr
    assert s.get_last_lr() == [0.01]
    # lr = 0.01 + 0.09 * log(k + 1) / log(10)
    assert lrs_by_stepping(s, 2) == pytest.approx([0.01, 0.01 + 0.09 * LOG10_2], rel=1e-12)
    assert lr_at(s, 4) == pytest.approx(0.01 + 0.09 * LOG10_5, rel=1e-12)
    assert lr_at(s, 9) == pytest.approx(0.1, rel=1e-12)  # log(10)/log(10): peak one step early
    assert lr_at(s, 50) == 0.1


def test_warmup_linear():
    s = WarmupLR(adam(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    assert lrs_by_stepping(s, 6) == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1], rel=1e-12)


def test_warmup_max_defaults_to_optimizer_lr_and_one_step_warmup_lasts_two():
    s = WarmupLR(adam(lr=0.4), warmup_num_steps=1, warmup_type="linear")
    assert lrs_by_stepping(s, 3) == pytest.approx([0.0, 0.2, 0.4], rel=1e-12)


def test_warmup_per_group_lists():
    opt = adam(groups=2)
    WarmupLR(opt, warmup_min_lr=[0.0, 0.5], warmup_max_lr=[1.0, 1.5], warmup_num_steps=4, warmup_type="linear")
    opt_lrs = [g["lr"] for g in opt.param_groups]
    assert opt_lrs == [0.0, 0.5]


# ---- WarmupDecayLR ----------------------------------------------------------------------------


def test_warmup_decay_linear_to_zero():
    s = WarmupDecayLR(adam(), total_num_steps=12, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    assert s.optimizer.param_groups[0]["lr"] == 0.0
    assert lr_at(s, 2) == pytest.approx(0.05, rel=1e-12)
    # after warmup: 0.1 * (12 - k) / (12 - 4)
    assert lr_at(s, 4) == pytest.approx(0.1, rel=1e-12)
    assert lr_at(s, 6) == pytest.approx(0.075, rel=1e-12)
    assert lr_at(s, 10) == pytest.approx(0.025, rel=1e-12)
    assert lr_at(s, 12) == 0.0
    assert lr_at(s, 20) == 0.0  # clamped, never negative


def test_warmup_decay_default_peak_is_0_001_not_the_optimizer_lr():
    s = WarmupDecayLR(adam(lr=0.5), total_num_steps=100, warmup_num_steps=10)
    assert lr_at(s, 10) == pytest.approx(0.001, rel=1e-12)


# ---- WarmupCosineLR ---------------------------------------------------------------------------


def test_warmup_cosine():
    opt = adam(lr=0.2)
    s = WarmupCosineLR(
        opt, total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.05, warmup_type="linear"
    )
    assert opt.param_groups[0]["lr"] == 0.0  # starts at 0, not at warmup_min_ratio * lr
    assert lr_at(s, 0) == pytest.approx(0.2 * 0.1, rel=1e-12)
    assert lr_at(s, 2) == pytest.approx(0.2 * (0.1 + 0.5 * 0.9), rel=1e-12)
    # decay: progress = (k - 4 + 1) / (12 - 4); ratio = 0.05 + 0.95 * (1 + cos(pi * progress)) / 2
    assert lr_at(s, 4) == pytest.approx(0.2 * (0.05 + 0.95 * (1 + COS_PI_8) / 2), rel=1e-12)
    assert lr_at(s, 7) == pytest.approx(0.2 * (0.05 + 0.95 * 0.5), rel=1e-12)
    assert lr_at(s, 11) == pytest.approx(0.2 * 0.05, rel=1e-12)
    assert lr_at(s, 30) == pytest.approx(0.2 * 0.05, rel=1e-12)  # stays at the floor
    assert s.get_lr_ratio() == pytest.approx(0.05, rel=1e-12)


# ---- OneCycle ---------------------------------------------------------------------------------


def one_cycle(opt, **kw):
    params = dict(cycle_min_lr=0.01, cycle_max_lr=0.11, cycle_first_step_size=4, cycle_second_step_size=6)
    params.update(kw)
    return OneCycle(opt, **params)


def test_one_cycle_lr_and_momentum_over_a_cycle():
    opt = adam()
    s = one_cycle(opt)
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)  # min momentum at construction; beta2 pinned to 0.99
    # position x = (k + 1) / 10; rising while x <= 0.4 (scale x / 0.4), then falling (scale (x - 1) / -0.6)
    expected = {0: (0.035, 0.875), 3: (0.11, 0.8), 6: (0.06, 0.85), 8: (0.01 + 0.1 / 6, 0.9 - 0.1 / 6), 9: (0.01, 0.9)}
    for k, (lr, mom) in expected.items():
        s.step(k)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12), k
        beta1, beta2 = opt.param_groups[0]["betas"]
        assert (beta1, beta2) == (pytest.approx(mom, rel=1e-12), 0.99), k


def test_one_cycle_decay_after_the_cycle():
    opt = adam()
    s = one_cycle(opt, decay_step_size=2, decay_lr_rate=0.5, decay_mom_rate=0.1)
    # d = k - 10 + 1; lr = 0.01 / (1 + 0.5 * d / 2); beta1 = 0.9 * (1 + 0.1 * d / 2)
    s.step(10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.008, rel=1e-12)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.945, rel=1e-12)
    s.step(13)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005, rel=1e-12)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(1.08, rel=1e-12)


def test_one_cycle_without_decay_holds_min_lr():
    s = one_cycle(adam(), decay_lr_rate=0.5)  # decay_step_size 0: no decay
    assert lr_at(s, 25) == 0.01


def test_one_cycle_staircase():
    s = one_cycle(adam(), cycle_first_stair_count=2, cycle_second_stair_count=3)
    # rising: floor((k+1) * 2 / 4) / 2; falling: floor((10 - (k+1)) * 3 / 6) / 3
    expected = {0: 0.01, 1: 0.06, 2: 0.06, 3: 0.11, 4: 0.01 + 0.1 * 2 / 3, 6: 0.01 + 0.1 / 3, 8: 0.01}
    for k, lr in expected.items():
        assert lr_at(s, k) == pytest.approx(lr, rel=1e-12), k


def test_one_cycle_leaves_optimizers_without_betas_alone():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.5)
    s = one_cycle(opt)
    s.step()
    assert s.get_mom() is None
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.5


# ---- LRRangeTest ------------------------------------------------------------------------------


def test_lr_range_test_continuous_and_staircase():
    smooth = LRRangeTest(adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=0.5)
    assert smooth.optimizer.param_groups[0]["lr"] == 0.01
    # 0.01 * (1 + 0.5 * (k + 1) / 4)
    assert lr_at(smooth, 0) == pytest.approx(0.01125, rel=1e-12)
    assert lr_at(smooth, 7) == pytest.approx(0.02, rel=1e-12)
    stairs = LRRangeTest(
        adam(),
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=4,
        lr_range_test_step_rate=0.5,
        lr_range_test_staircase=True,
    )
    assert lr_at(stairs, 2) == 0.01
    assert lr_at(stairs, 3) == pytest.approx(0.015, rel=1e-12)
    assert lr_at(stairs, 11) == pytest.approx(0.025, rel=1e-12)


# ---- shared protocol --------------------------------------------------------------------------


ALL_CASES = [
    ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5)),
    ("WarmupDecayLR", dict(total_num_steps=20, warmup_num_steps=5)),
    ("WarmupCosineLR", dict(total_num_steps=20, warmup_num_steps=5)),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3, decay_step_size=2,
                      decay_lr_rate=1)),  # fmt: skip
    ("LRRangeTest", dict(lr_range_test_step_size=3)),
]


@pytest.mark.parametrize("name,params", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_state_dict_round_trip_resumes_the_same_schedule(name, params):
    reference = SCHEDULERS[name](adam(), **params)
    first = lrs_by_stepping(reference, 7)
    state = reference.state_dict()
    assert state == {"last_batch_iteration": 6}
    rest = lrs_by_stepping(reference, 8)

    resumed_opt = adam()
    resumed = SCHEDULERS[name](resumed_opt, **params, last_batch_iteration=6)
    resumed.load_state_dict(state)
    assert lrs_by_stepping(resumed, 8) == rest
    uninterrupted = lrs_by_stepping(SCHEDULERS[name](adam(), **params), 15)
    assert first + rest == uninterrupted  # taking the state dict does not disturb the schedule
    assert rest != uninterrupted[:8]  # a resume that lost its position (started over) would fail above


@pytest.mark.parametrize("name,params", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_resumed_scheduler_does_not_touch_lr_until_stepped(name, params):
    opt = adam(lr=0.123)
    s = SCHEDULERS[name](opt, **params, last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.123
    with pytest.raises(RuntimeError, match=r"get_last_lr: .*Call step\(\) first\."):
        s.get_last_lr()
    s.step()
    assert s.last_batch_iteration == 5
    assert s.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_step_accepts_deepspeeds_batch_iteration_name():
    s = LRRangeTest(adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4)
    s.step(batch_iteration=7)
    assert s.last_batch_iteration == 7
    with pytest.raises(ValueError, match="batch_iteration: must not be given together"):
        s.step(3, batch_iteration=7)


def test_tensor_lr_is_filled_in_place():
    lr = torch.tensor(0.2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    s = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.0
    s.step(1)
    assert lr.item() == pytest.approx(0.1, rel=1e-6)  # org lr was kept as a copy, not the alias


def test_registry_names():
    assert set(SCHEDULERS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}


# ---- invalid parameters -----------------------------------------------------------------------


BAD = [
    (lambda o: WarmupLR(o, warmup_num_steps=-5),
     "warmup_num_steps: must be a positive integer; got -5. Set it to the number of batches"),
    (lambda o: WarmupLR(o, warmup_num_steps=0), "warmup_num_steps: must be a positive integer; got 0."),
    (lambda o: WarmupLR(o, warmup_num_steps=10.0), "warmup_num_steps: must be a positive integer; got 10.0."),
    (lambda o: WarmupLR(o, warmup_type="cosine"),
     "warmup_type: must be 'log' or 'linear'; got 'cosine'. Use one of 'log', 'linear'."),
    (lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_type="exp"),
     "warmup_type: must be 'log' or 'linear'; got 'exp'."),
    (lambda o: WarmupDecayLR(o, total_num_steps=-1), "total_num_steps: must be >= 0; got -1. Set it to"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.1]),
     "warmup_min_lr: must be a single number or a list with one entry per param group (1); got [0.0, 0.1]. "
     "Give one value, or 1 values in param-group order."),
    (lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=0),
     "cycle_first_step_size: must be > 0; got 0. Set it to the number of batches the lr takes to climb"),
    (lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=-3), "cycle_first_step_size: must be > 0; got -3."),
    (lambda o: OneCycle(o, 0.01, 0.1, cycle_second_step_size=-1), "cycle_second_step_size: must be >= 0; got -1."),
    (lambda o: OneCycle(o, 0.01, 0.1, cycle_first_stair_count=-2),
     "cycle_first_stair_count: must be >= 0; got -2. Use 0 for a smooth ramp"),
    (lambda o: OneCycle(o, 0.01, 0.1, decay_step_size=-1), "decay_step_size: must be >= 0; got -1."),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0),
     "lr_range_test_step_size: must be a positive integer; got 0. Set it to the number of batches per lr increase"),
]  # fmt: skip


@pytest.mark.parametrize("build,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_params_name_the_param_the_value_and_the_fix(build, message):
    opt = adam(lr=0.5)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build(opt)
    assert opt.param_groups[0]["lr"] == 0.5  # rejected before touching the optimizer


def test_wrapped_optimizer_is_unwrapped_and_other_objects_are_rejected():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = adam()
    WarmupLR(Wrapper(opt), warmup_min_lr=0.003)
    assert opt.param_groups[0]["lr"] == 0.003
    with pytest.raises(TypeError, match="optimizer: must be a torch.optim.Optimizer"):
        WarmupLR(object())
