"""Lion against the update rule of its paper (Chen et al. 2023, Algorithm 2), written out in float64."""

from __future__ import annotations

import torch

from shardwise.config import OptimizerConfig
from shardwise.optim.lion import Lion
from shardwise.optim.registry import build_optimizer


def paper_lion(p, grads, lr, beta1, beta2, wd):
    """theta -= lr * (sign(beta1*m + (1-beta1)*g) + wd*theta); m = beta2*m + (1-beta2)*g."""
    p, m = p.double().clone(), torch.zeros_like(p, dtype=torch.float64)
    for g in grads:
        g = g.double()
        update = torch.sign(beta1 * m + (1 - beta1) * g)
        p = p - lr * (update + wd * p)
        m = beta2 * m + (1 - beta2) * g
    return p


def test_lion_follows_the_paper_over_many_steps_in_two_groups():
    torch.manual_seed(0)
    start = [torch.randn(17, 5), torch.randn(9)]
    grads = [[torch.randn_like(s) for _ in range(25)] for s in start]
    params = [torch.nn.Parameter(s.clone()) for s in start]
    opt = Lion([{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}],
               lr=3e-3, betas=(0.9, 0.99))
    for step in range(25):
        for p, g in zip(params, grads):
            p.grad = g[step].clone()
        opt.step()
    for p, s, g, wd in zip(params, start, grads, (0.1, 0.0)):
        torch.testing.assert_close(p.detach().double(), paper_lion(s, g, 3e-3, 0.9, 0.99, wd), rtol=0, atol=1e-6)


def test_lion_moves_each_weight_by_exactly_lr_without_decay():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Lion([p], lr=0.5)
    p.grad = torch.tensor([3.0, -1e-9, 0.0, -2.0])
    opt.step()
    assert p.tolist() == [-0.5, 0.5, 0.0, 0.5]  # sign(0) = 0: a zero gradient does not move the weight


def test_deepspeed_lion_params_build_the_same_optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer(OptimizerConfig(type="Lion", params={"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.01,
                                                               "set_grad_none": True, "fp32_optimizer_states": True}),
                          [{"params": [p]}])
    assert isinstance(opt, Lion)
    assert opt.param_groups[0]["betas"] == (0.95, 0.98) and opt.param_groups[0]["weight_decay"] == 0.01
    p.grad = torch.ones(3)
    opt.step()
    state = opt.state_dict()
    again = Lion([torch.nn.Parameter(torch.ones(3))])
    again.load_state_dict(state)
    assert torch.equal(again.state[again.param_groups[0]["params"][0]]["exp_avg"], opt.state[p]["exp_avg"])
