"""Optimizer state of one-element parameters in checkpoints: a model whose optimizer meets a one-element (or
0-d) parameter first still resumes exactly.

The manifest keeps the optimizer's scalars (Adam's step) from one parameter's state; read from a one-element
parameter, its moments looked like scalars too, and loading then replaced every parameter's moments with that
one number (stage 0 AdamW: a crash in the foreach kernels; OneBitAdam: a shape error).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise
from tests.harness import run_distributed
from tests.parity import TinyNet, train_steps


class _Scaled(TinyNet):
    """TinyNet with a learned temperature (shape (1,)) and a learned 0-d offset."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.ones(1))
        self.offset = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens, labels) * self.temperature[0] + self.offset


def _engine(optimizer: str, params: dict):
    torch.manual_seed(0)
    model = _Scaled()
    rest = [(n, p) for n, p in model.named_parameters() if n not in ("temperature", "offset") and p.requires_grad]
    groups = [{"params": [model.temperature] + [p for _, p in rest if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [model.offset] + [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": optimizer, "params": {"lr": 1e-2, **params}}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=groups, config=config)
    return engine


CASES = [("AdamW", {}), ("OneBitAdam", {"freeze_step": 2})]


def _as_older_manifest(path: Path) -> None:
    """What a manifest written before the fix held: the first parameter's one-element moments as scalars."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["optimizer"]["scalars"].update(exp_avg=123.0, exp_avg_sq=456.0)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _resume(root: str) -> list[tuple[dict, list[float], dict[str, list[float]], dict[str, bool]]]:
    dist.init_process_group("gloo")
    out = []
    for optimizer, params in CASES:
        engine = _engine(optimizer, params)
        train_steps(engine, 0, 3)
        for tag in ("now", "older"):
            engine.save_checkpoint(f"{root}/{optimizer}", tag=tag)
        scalars = json.loads(Path(root, optimizer, "now", "manifest.json").read_text())["optimizer"]["scalars"]
        if dist.get_rank() == 0:
            _as_older_manifest(Path(root, optimizer, "older"))
        dist.barrier()
        uninterrupted, again, same = train_steps(engine, 3, 3), {}, {}
        for tag in ("now", "older"):
            resumed = _engine(optimizer, params)
            resumed.load_checkpoint(f"{root}/{optimizer}", tag=tag)
            again[tag] = train_steps(resumed, 3, 3)
            same[tag] = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), resumed.module.parameters()))
        out.append((scalars, uninterrupted, again, same))
    return out


def test_one_element_parameters_first_in_the_optimizer_resume_exactly(tmp_path):
    results = run_distributed(_resume, 2, str(tmp_path))[0]
    for (optimizer, _), (scalars, uninterrupted, again, same) in zip(CASES, results):
        assert scalars == {"step": 3.0}, optimizer  # the moments are element-wise state, not scalars
        for tag in ("now", "older"):
            assert again[tag] == uninterrupted, (optimizer, tag)
            assert same[tag], (optimizer, tag)
