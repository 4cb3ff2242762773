"""shardwise.optim.adam.CPUAdam: DeepSpeedCPUAdam's interface, torch's arithmetic."""

from __future__ import annotations

import pytest
import torch

from shardwise.optim.adam import CPUAdam


def _run(make, steps=5):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = make([p])
    for i in range(steps):
        p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(i))
        opt.step()
    return p.detach()


def test_adamw_mode_matches_torch_adamw():
    ours = _run(lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.1))
    ref = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_adam_mode_matches_torch_adam_with_l2():
    ours = _run(lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False))
    ref = _run(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match="bias_correction=False is not supported"):
        CPUAdam([torch.nn.Parameter(torch.zeros(1))], bias_correction=False)
