"""Lamb against a plain-Python transcription of DeepSpeed FusedLamb's kernel, 3 steps on tiny tensors.

The reference works on lists of floats (double precision) and the optimizer on float64 tensors, so
the two must agree to ~1e-12.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from shardwise.optim.lamb import Lamb

INIT = [[0.5, -1.0, 2.0, 0.25], [0.3, -0.7], [0.0, 0.0, 0.0]]  # the last one has ||p|| = 0: ratio 1
GRADS = [  # GRADS[step][tensor]
    [[0.1, -0.2, 0.3, 0.05], [1.5, -0.4], [0.2, 0.1, -0.3]],
    [[-0.3, 0.1, 0.2, 0.4], [0.9, 0.8], [-0.1, 0.5, 0.2]],
    [[0.05, 0.05, -0.6, 0.1], [-1.1, 0.3], [0.3, -0.2, 0.1]],
]


def norm(xs):
    return math.sqrt(sum(x * x for x in xs))


def reference_lamb(
    params,
    grads_per_step,
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    eps_inside_sqrt=False,
    weight_decay=0.0,
    bias_correction=True,
    max_coeff=10.0,
    min_coeff=0.01,
    max_grad_norm=0.0,
    scale=1.0,
):
    """Returns the params after each step and the trust ratios of each step."""
    b1, b2 = betas
    params = [list(p) for p in params]
    m = [[0.0] * len(p) for p in params]
    v = [[0.0] * len(p) for p in params]
    history, coeffs = [], []
    for t, grads in enumerate(grads_per_step, start=1):
        divisor = scale
        if max_grad_norm > 0:  # one group: the norm over all its gradients
            clip = (norm([g for gs in grads for g in gs]) / scale + 1e-6) / max_grad_norm
            divisor = clip * scale if clip > 1 else scale
        step_coeffs = []
        for i, p in enumerate(params):
            g = [x / divisor for x in grads[i]]
            m[i] = [b1 * mj + (1 - b1) * gj for mj, gj in zip(m[i], g)]
            v[i] = [b2 * vj + (1 - b2) * gj * gj for vj, gj in zip(v[i], g)]
            denom = [math.sqrt(vj + eps) if eps_inside_sqrt else math.sqrt(vj) + eps for vj in v[i]]
            # no bias correction inside the update: it only scales the step below
            u = [mj / dj + weight_decay * pj for mj, dj, pj in zip(m[i], denom, p)]
            w_norm, u_norm = norm(p), norm(u)
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
            params[i] = [pj - step_size * coeff * uj for pj, uj in zip(p, u)]
            step_coeffs.append(coeff)
        history.append([list(p) for p in params])
        coeffs.append(step_coeffs)
    return history, coeffs


def run_lamb(grads_per_step, scale=1.0, **kw):
    params = [torch.nn.Parameter(torch.tensor(p, dtype=torch.float64)) for p in INIT]
    opt = Lamb(params, **kw)
    history, coeffs = [], []
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step(scale=scale)
        history.append([p.detach().tolist() for p in params])
        coeffs.append(opt.get_lamb_coeffs())
    return history, coeffs, opt


CASES = {
    "defaults": dict(),
    "weight_decay_eps_inside_no_bias_correction": dict(
        lr=0.01, weight_decay=0.1, eps=1e-3, eps_inside_sqrt=True, bias_correction=False, betas=(0.8, 0.9)
    ),
    "ratio_clamped_high": dict(lr=0.01, max_coeff=0.3, min_coeff=0.01),
    "ratio_clamped_low": dict(lr=0.01, max_coeff=10.0, min_coeff=2.0),
    "loss_scale_and_clipping": dict(lr=0.01, max_grad_norm=0.5, weight_decay=0.01),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_reference_for_three_steps(name):
    kw = CASES[name]
    scale = 8.0 if "max_grad_norm" in kw else 1.0
    grads = [[[g * scale for g in gs] for gs in step] for step in GRADS]  # gradients carry the loss scale
    expected, expected_coeffs = reference_lamb(INIT, grads, scale=scale, **kw)
    got, coeffs, _ = run_lamb(grads, scale=scale, **kw)
    for step in range(3):
        for got_p, want_p in zip(got[step], expected[step]):
            assert got_p == pytest.approx(want_p, rel=1e-12, abs=1e-15), (name, step)
        assert coeffs[step] == pytest.approx(expected_coeffs[step], rel=1e-12), (name, step)


def test_cases_exercise_what_they_claim():
    _, high = reference_lamb(INIT, GRADS, lr=0.01, max_coeff=0.3)
    _, low = reference_lamb(INIT, GRADS, lr=0.01, min_coeff=2.0)
    assert 0.3 in high[0] and 2.0 in low[0]
    assert high[0][2] == 1.0  # the zero tensor
    clipped_grads = [[[g * 8 for g in gs] for gs in s] for s in GRADS]
    assert norm([g for gs in clipped_grads[0] for g in gs]) / 8 > 0.5  # the clip really triggers


def test_state_layout_and_params_without_grad_are_skipped():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2))
    opt = Lamb([a, b])
    a.grad = torch.full((3,), 0.5)
    opt.step()
    opt.step()
    assert set(opt.state[a]) == {"step", "exp_avg", "exp_avg_sq"} and opt.state[a]["step"] == 2
    assert b not in opt.state and torch.equal(b.detach(), torch.ones(2))
    assert len(opt.get_lamb_coeffs()) == 1


def test_grad_is_not_modified_and_state_dict_round_trips():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = Lamb([p], lr=0.1, max_grad_norm=0.1)
    p.grad = torch.tensor([3.0, 4.0])
    opt.step(scale=2.0)
    assert p.grad.tolist() == [3.0, 4.0]
    q = torch.nn.Parameter(p.detach().clone())
    other = Lamb([q], lr=0.1, max_grad_norm=0.1)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch shares state tensors otherwise
    p.grad = q.grad = torch.tensor([-1.0, 0.5])
    opt.step()
    other.step()
    assert torch.equal(p.detach(), q.detach())


def test_closure_loss_is_returned():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = Lamb([p])

    def closure():
        opt.zero_grad()
        loss = (p * 3).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert p.item() < 1.0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lr=-1.0), "lr: must be >= 0; got -1.0. Set lr to a non-negative number."),
        (dict(betas=(0.9, 1.0)), "betas: must be two numbers in [0, 1); got (0.9, 1.0). Use e.g. [0.9, 0.999]."),
        (dict(amsgrad=True), "amsgrad: is not supported by Lamb"),
        (dict(min_coeff=1.0, max_coeff=0.5), "max_coeff: must be >= min_coeff (1.0) and min_coeff >= 0; got 0.5."),
    ],
)
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        Lamb([torch.nn.Parameter(torch.ones(1))], **kwargs)
