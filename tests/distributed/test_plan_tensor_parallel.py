"""`shardwise plan` and the engine's step-2 check give one account of a tensor-parallel rank (world 2, AutoTP 2):
the CLI's model is the engine's split module part for part, and the CLI's plan is what the engine-side planner
computes for that rank and config."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import torch

from tests.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune_llm" / "tiny_llama"
SEQ, MICRO = 64, 2
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "tensor_parallel": {"autotp_size": 2}, "memory_breakdown": True, "steps_per_print": 1000}


def _engine_side(cli: dict[str, Any]) -> dict[str, Any]:
    import transformers

    import shardwise
    from shardwise.planner import ActivationProfile, ModelShape, plan

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY))
    engine, *_ = shardwise.initialize(model=model, config=CONFIG)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 512, (MICRO, SEQ), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    check = engine.plan_probe.check
    traced = ActivationProfile.from_json(cli["activations"])
    # the probe's own planning call (planner/probe.py), given the CLI's traced activations instead of its measured ones
    same_inputs = plan(ModelShape.of(engine.module), engine.config, engine.topology.data.size, traced)
    return {"shape": ModelShape.of(engine.module).to_json(), "probe": check.planned.to_json(),
            "same_inputs": same_inputs.to_json(), "rank": engine.global_rank}


def test_the_cli_plans_the_rank_the_engine_plans(tmp_path: Path) -> None:
    from shardwise.planner.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--model", str(TINY), "--config", str(path), "--world", "2", "--seq_len", str(SEQ), "--json"]) == 0
    cli = json.loads(out.getvalue())
    engine = run_distributed(_engine_side, 2, cli, timeout=240)[0]
    assert {**engine["shape"], "module_sizes": len(engine["shape"]["module_sizes"])} == cli["model"]
    assert engine["same_inputs"] == {k: v for k, v in cli.items() if k in engine["same_inputs"]}
    probe = engine["probe"]
    # the step-2 check counts activations measured in the run; everything else is the same account
    for part in probe["parts"]:
        if part != "activations":
            assert probe["parts"][part] == cli["parts"][part], part
    assert probe["world"] == cli["world"] == 1
    assert abs(cli["peak_device"] / probe["peak_device"] - 1) < 0.02, (cli["peak_device"], probe["peak_device"])
