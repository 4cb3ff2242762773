"""The ZeRO paper's model-state formula and the estimator built on it."""

from __future__ import annotations

import torch

from shardwise.zero import estimate_model_states_memory, formula_bytes


def test_formula_per_stage_mixed_precision():
    psi, n = 1000, 4
    assert formula_bytes(psi, n, 0, 2, 2, 12).total == 16 * psi
    assert formula_bytes(psi, n, 1, 2, 2, 12).total == 4 * psi + 12 * psi // n
    assert formula_bytes(psi, n, 2, 2, 2, 12).total == 2 * psi + 14 * psi // n
    assert formula_bytes(psi, n, 3, 2, 2, 12).total == 16 * psi // n


def test_estimator_counts_trainable_parameters_and_offload(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    model[1].requires_grad_(False)
    numel = 100 * 100 + 100
    est = estimate_model_states_memory(model, num_gpus=2, num_nodes=2, stage=2, offload=True)
    assert est["params"] == 2 * numel and est["host"] == 12 * numel // 4
    assert est["device"] == 2 * numel + 2 * numel // 4
    assert "stage 2, 4 rank(s)" in capsys.readouterr().out
