"""`save_checkpoint(exclude_frozen_parameters=True)` (what Hugging Face's Trainer asks for a peft model): the
frozen parameters stay out of the files, a strict load says why it cannot find them, and a non-strict load
continues the run exactly, the frozen parameters keeping the values the model was built with."""

from __future__ import annotations

import json

import pytest

from shardwise.checkpoint import CheckpointError
from tests.harness import run_distributed
from tests.parity import ds_config, engine_run, make_model, param_groups, train_steps

FROZEN = {"frozen.weight", "frozen.bias"}


def _save_and_resume(stage, root):
    import shardwise

    config = ds_config(2, 1, zero_optimization={"stage": stage})
    _, _, engine = engine_run(config, 3)
    engine.save_checkpoint(root, tag="lean", exclude_frozen_parameters=True)
    engine.save_checkpoint(root, tag="whole")
    uninterrupted = train_steps(engine, 3, 3)
    model = make_model()
    fresh, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    with pytest.raises(CheckpointError, match="saved with exclude_frozen_parameters=True") as refused:
        fresh.load_checkpoint(root, tag="lean")
    fresh.load_checkpoint(root, tag="lean", load_module_strict=False)
    return uninterrupted, train_steps(fresh, 3, 3), str(refused.value)


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters_left_out_and_resumed(stage, tmp_path):
    for uninterrupted, resumed, message in run_distributed(_save_and_resume, 2, stage, str(tmp_path)):
        assert resumed == pytest.approx(uninterrupted, rel=1e-6)
        assert "frozen.weight" in message
    lean = json.loads((tmp_path / "lean" / "manifest.json").read_text())
    whole = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert set(whole["params"]) - set(lean["params"]) == FROZEN and lean["frozen_parameters_excluded"]
    size = lambda tag: sum(f.stat().st_size for f in (tmp_path / tag).glob("rank*.safetensors"))  # noqa: E731
    frozen_bytes = sum(p.numel() * 4 for n, p in make_model().named_parameters() if n in FROZEN)
    assert size("whole") - size("lean") >= frozen_bytes
