"""A checkpoint or state dict of other shapes is refused, every mismatch listed with both shapes.

Loading reads parameters by element range, so a checkpoint of hidden size 32 used to load into the same
model at hidden size 24 by taking the first elements of each tensor. Now every stage (with and without
offload), `load_module_state_dict`, `zero.load_state_dict_partitioned` and the consolidation tool refuse.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path


import shardwise
from shardwise.checkpoint import cli
from tests.faults.checkpoint_models import error_of, tiny_engine, tiny_model, train_step
from tests.harness import run_distributed

LAYOUTS = {  # name: (stage, extra zero_optimization keys)
    "stage0": (0, {}), "stage1": (1, {}), "stage2": (2, {}), "stage3": (3, {}),
    "stage2-offload": (2, {"offload_optimizer": {"device": "cpu"}}),
    "stage3-offload": (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
}


def _mismatches(saved: int, model: int) -> list[str]:
    """What the error lists: every parameter of the hidden size in the model's order, then the buffers."""
    shapes = {"0.weight": lambda d: (d, d), "0.bias": lambda d: (d,), "1.weight": lambda d: (d,),
              "1.bias": lambda d: (d,), "2.weight": lambda d: (4, d), "1.running_mean": lambda d: (d,),
              "1.running_var": lambda d: (d,)}
    return [f"{name!r}: checkpoint {shape(saved)}, model {shape(model)}" for name, shape in shapes.items()]


def _cross_load(root: str) -> dict[str, list[str]]:
    out = {}
    for name, (stage, zero) in LAYOUTS.items():
        for dim in (32, 24):
            engine = tiny_engine(dim, stage, zero=zero)
            train_step(engine)
            engine.save_checkpoint(f"{root}/{name}/{dim}")
        out[name] = [error_of(tiny_engine(dim, stage, zero=zero).load_checkpoint, f"{root}/{name}/{saved}",
                              load_module_strict=strict)
                     for saved, dim, strict in ((32, 24, True), (24, 32, False))]
    return out


def test_load_checkpoint_refuses_other_shapes_at_every_stage(tmp_path: Path) -> None:
    per_rank = run_distributed(_cross_load, 2, str(tmp_path), timeout=400)
    assert per_rank[0] == per_rank[1]  # the same error on every rank, whichever slices it holds
    for name, messages in per_rank[0].items():
        for (saved, model), message in zip(((32, 24), (24, 32)), messages):
            path = tmp_path / name / str(saved) / "global_step1"
            assert message == (f"CheckpointError: {path}: 7 shape(s) differ between the checkpoint and the model: "
                               f"{'; '.join(_mismatches(saved, model))}. A checkpoint loads only into a model of the "
                               "same shapes (load_module_strict=False skips missing names, never different shapes); "
                               "build the model with the configuration it was saved from."), f"{name}: {message}"


def _state_dict_into(stage: int) -> list[str]:
    big = {k: v.clone() for k, v in tiny_model(32).state_dict().items()}
    engine = tiny_engine(24, stage)
    return [error_of(engine.strategy.load_module_state_dict, big, strict=strict) for strict in (True, False)]


def test_load_module_state_dict_refuses_other_shapes() -> None:
    for stage in (0, 1, 2):  # torch's load_state_dict refuses, naming each mismatch
        for message in run_distributed(_state_dict_into, 1, stage)[0]:
            assert message.startswith("RuntimeError: Error(s) in loading state_dict for Sequential:"), message
            assert "size mismatch for 0.weight: copying a param with shape torch.Size([32, 32])" in message
            assert "size mismatch for 2.weight" in message
    for message in run_distributed(_state_dict_into, 2, 3)[0]:
        assert message == ("ValueError: load_module_state_dict: 5 shape(s) differ between the state dict and the "
                           "model: '0.weight': state dict (32, 32), model (24, 24); '0.bias': state dict (32,), model "
                           "(24,); '1.weight': state dict (32,), model (24,); '1.bias': state dict (32,), model (24,); "
                           "'2.weight': state dict (4, 32), model (4, 24). Load a state dict of a model built with the "
                           "same configuration."), message


def _partitioned() -> list[str]:
    big = {k: v.clone() for k, v in tiny_model(32).state_dict().items()}
    with shardwise.zero.Init():
        model = tiny_model(24)
    return [error_of(shardwise.zero.load_state_dict_partitioned, model, big, strict=strict) for strict in (True, False)]


def test_load_state_dict_partitioned_refuses_other_shapes() -> None:
    for message in run_distributed(_partitioned, 2)[0]:
        assert message.startswith("ValueError: load_state_dict_partitioned: 7 shape(s) differ between the state "
                                  "dict and the model: '0.weight': state dict (32, 32), model (24, 24); "), message
        assert "'1.running_var': state dict (32,), model (24,)" in message


def _save(root: str) -> None:
    engine = tiny_engine(32, 2)
    train_step(engine)
    engine.save_checkpoint(root, tag="t")


def test_consolidation_refuses_a_manifest_whose_shapes_disagree_with_its_pieces(tmp_path: Path, capsys) -> None:
    run_distributed(_save, 2, str(tmp_path / "saved"))
    for shape, expected in (([24, 32], r"parameter '0.weight' \(shape \(24, 32\), 768 elements\) has a piece "
                                       r"\[\d+, 1024\) outside it"),
                            ([40, 32], r"the pieces of parameter '0.weight' do not cover its shape \(40, 32\)")):
        root = tmp_path / str(shape[0])
        shutil.copytree(tmp_path / "saved", root)
        manifest = root / "t" / "manifest.json"
        meta = json.loads(manifest.read_text())
        meta["params"]["0.weight"]["shape"] = shape
        manifest.write_text(json.dumps(meta))
        assert cli.main(["to-fp32", str(root), str(tmp_path / "out")]) == 2
        assert re.fullmatch(f"shardwise checkpoint: error: {re.escape(str(manifest))}: inconsistent \\({expected}\\); "
                            "the manifest is corrupt or was edited.\n", capsys.readouterr().err)
        assert not (tmp_path / "out" / "model.safetensors").exists()
