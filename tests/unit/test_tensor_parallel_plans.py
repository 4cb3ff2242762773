"""AutoTP plans for models written with shardwise.tensor_parallel.layers: no plan is needed, none is invented."""

from __future__ import annotations

import pytest
import torch

from shardwise.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelError,
    resolve_plan,
)


class Declared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = ColumnParallelLinear(4, 8), RowParallelLinear(8, 4)
        self.lm_head = torch.nn.Linear(4, 4)  # named like an HF head, but no HF config: left whole


def test_a_model_whose_layers_declare_styles_needs_no_plan_and_gets_no_rules():
    assert resolve_plan(Declared()) == []  # no built-in, HF or vocabulary-parallel rules: only what it declares


def test_a_model_with_no_plan_and_nothing_declared_is_refused():
    with pytest.raises(TensorParallelError, match=r"no AutoTP plan for model type None \(Sequential\)"):
        resolve_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_a_pipeline_stage_defers_the_refusal_to_the_stages_together():
    assert resolve_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), required=False) == []
