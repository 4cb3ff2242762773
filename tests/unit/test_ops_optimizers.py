"""shardwise.optim.adam and Lamb: DeepSpeed's optimizer constructors, checked against the update rules written out here
(not against the torch classes they are built on)."""

from __future__ import annotations

import pytest
import torch

from shardwise.optim.adam import CPUAdagrad, CPUAdam, FusedAdam
from shardwise.optim.lamb import Lamb as FusedLamb

STEPS, N = 4, 50


def _grads():
    return [torch.randn(N, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]


def _run(make):
    p = torch.nn.Parameter(torch.linspace(-1, 1, N))
    opt = make([p])
    for g in _grads():
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _adam(lr, betas, eps, wd, decoupled):
    p, m, v = torch.linspace(-1, 1, N).double(), torch.zeros(N).double(), torch.zeros(N).double()
    for t, g in enumerate(_grads(), start=1):
        g = g.double()
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p.float()


@pytest.mark.parametrize("cls,mode_kw", [(FusedAdam, "adam_w_mode"), (CPUAdam, "adamw_mode")])
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_matches_the_update_rule(cls, mode_kw, decoupled):
    ours = _run(lambda ps: cls(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **{mode_kw: decoupled}))
    torch.testing.assert_close(ours, _adam(1e-2, (0.9, 0.95), 1e-8, 0.1, decoupled), rtol=1e-5, atol=1e-6)


def test_adagrad_matches_the_update_rule():
    ours = _run(lambda ps: CPUAdagrad(ps, lr=0.1, eps=1e-10, weight_decay=0.01))
    p, acc = torch.linspace(-1, 1, N).double(), torch.zeros(N).double()
    for g in _grads():
        g = g.double() + 0.01 * p
        acc = acc + g * g
        p = p - 0.1 * g / (acc.sqrt() + 1e-10)
    torch.testing.assert_close(ours, p.float(), rtol=1e-5, atol=1e-6)


def test_fused_lamb_is_shardwise_lamb():
    from shardwise.optim.lamb import Lamb

    assert FusedLamb is Lamb


def test_refusals_name_the_argument():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="FusedAdam: amsgrad=True is not supported"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="FusedAdam: bias_correction=False"):
        FusedAdam(p, bias_correction=False)
    with pytest.raises(ValueError, match="CPUAdagrad: amsgrad=True"):
        CPUAdagrad(p, amsgrad=True)
