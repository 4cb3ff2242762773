"""Checkpoints under tensor parallelism: saved at one tensor x data layout, resumed at another, the run goes on
exactly as one uninterrupted single-process run; the manifest records whole shapes with their parts; the
consolidated weights are the whole ones.

LLaMA covers row and column splits and the vocabulary-parallel embedding and head; GPT-2 adds the fused q/k/v
(3 blocks) and a tied head. SGD with momentum: its state is resharded along with the weights.
"""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise.checkpoint import cli
from shardwise.checkpoint.reader import CheckpointReader
from tests import tensor_parallel_models as tp_models
from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")

KINDS = ("llama", "gpt2")
SAVE_AT, MORE = 3, 3


@functools.cache
def _oracle(kind: str) -> dict:
    """The uninterrupted run: SAVE_AT + MORE steps in one process."""
    return tp_models.oracle(kind, steps=SAVE_AT + MORE)


def _engine(kind: str, tp: int, dp: int, stage: int):
    model = tp_models.build(kind)
    engine, *_ = shardwise.initialize(model=model, config=tp_models.config(tp, dp, stage))
    return engine


def _save(root: str, tp: int, dp: int, stage: int, kinds: tuple[str, ...] = KINDS) -> dict:
    """Train SAVE_AT steps at tp x dp and save; the losses and the whole weights at the save."""
    out = {}
    for kind in kinds:
        engine = _engine(kind, tp, dp, stage)
        losses = tp_models.train(engine, SAVE_AT)["losses"]
        engine.save_checkpoint(f"{root}/{kind}")
        out[kind] = {"losses": losses, "params": tp_models.whole_params(engine)}
    return out


def _resume(root: str, tp: int, dp: int, stage: int, kinds: tuple[str, ...] = KINDS) -> dict:
    out = {}
    for kind in kinds:
        engine = _engine(kind, tp, dp, stage)
        engine.load_checkpoint(f"{root}/{kind}")
        assert engine.global_steps == SAVE_AT
        out[kind] = tp_models.train(engine, MORE, start=SAVE_AT)["losses"]
    return out


def _save_at_tp2_dp2(root: str) -> dict:
    """At world 4: ZeRO-1 (both models) and ZeRO-3 (LLaMA: each rank holds a data-parallel slice of its part)."""
    return {"zero1": _save(f"{root}/tp2xdp2", 2, 2, 1), "zero3": _save(f"{root}/tp2xdp2-zero3", 2, 2, 3, ("llama",))}


def _resume_both_ways(root: str) -> dict:
    """At world 2: the tp2 x dp2 checkpoint at tp1 x dp2 (ZeRO-2) and at tp2 x dp1; the ZeRO-3 one at tp1 x dp2
    (ZeRO-3); then one saved at tp1 x dp2 (ZeRO-1) resumed at tp2 x dp1."""
    saved_at_tp2, tp1_root = f"{root}/tp2xdp2", f"{root}/tp1xdp2"
    return {"tp1xdp2": _resume(saved_at_tp2, 1, 2, 2), "tp2xdp1": _resume(saved_at_tp2, 2, 1, 0),
            "zero3 -> tp1xdp2": _resume(f"{root}/tp2xdp2-zero3", 1, 2, 3, ("llama",)),
            "saved at tp1": _save(tp1_root, 1, 2, 1), "tp1 -> tp2": _resume(tp1_root, 2, 1, 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_checkpoints")
    for kind in KINDS:  # first: the ranks fork with transformers' model modules imported
        _oracle(kind)
    saved = run_distributed(_save_at_tp2_dp2, 4, str(root), timeout=180)[0]
    resumed = run_distributed(_resume_both_ways, 2, str(root), timeout=180)[0]
    return root, saved["zero1"], resumed | {"zero3 saved": saved["zero3"]}


def _close(got: list[float], ref: list[float], label: str) -> None:
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label} step {i}: loss {a} vs oracle {b}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["tp1xdp2", "tp2xdp1", "tp1 -> tp2"])
def test_resumed_run_equals_the_uninterrupted_one(runs, kind, layout):
    _, saved, resumed = runs
    ref = _oracle(kind)["losses"]
    _close(saved[kind]["losses"], ref[:SAVE_AT], f"{kind} before the save at tp2 x dp2")
    _close(resumed["saved at tp1"][kind]["losses"], ref[:SAVE_AT], f"{kind} before the save at tp1 x dp2")
    _close(resumed[layout][kind], ref[SAVE_AT:], f"{kind} resumed at {layout}")


def test_zero3_checkpoint_at_tp2_dp2_resumes_at_tp1(runs):
    _, _, resumed = runs
    ref = _oracle("llama")["losses"]
    _close(resumed["zero3 saved"]["llama"]["losses"], ref[:SAVE_AT], "llama before the save at tp2 x dp2 ZeRO-3")
    _close(resumed["zero3 -> tp1xdp2"]["llama"], ref[SAVE_AT:], "llama resumed at tp1 x dp2 ZeRO-3")


def test_manifest_records_whole_shapes_and_parts(runs):
    root, _, _ = runs
    params = CheckpointReader(root / "tp2xdp2" / "llama").meta["params"]
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [32, 32] and q["tp"] == {"dim": 0, "parts": 2, "blocks": 1}
    for part in (0, 1):  # each part's pieces (a data-parallel rank's range of it, ZeRO-1) cover its 16 x 32 elements
        pieces = sorted((p["start"], p["end"]) for p in q["pieces"] if p["part"] == part)
        assert pieces[0][0] == 0 and pieces[-1][1] == 512, pieces
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), pieces
    down = params["model.layers.0.mlp.down_proj.weight"]
    assert down["shape"] == [32, 64] and down["tp"] == {"dim": 1, "parts": 2, "blocks": 1}
    assert params["model.embed_tokens.weight"]["tp"] == {"dim": 0, "parts": 2, "blocks": 1}
    norm = params["model.norm.weight"]  # replicated: written once, by tensor-parallel rank 0, without parts
    assert norm["shape"] == [32] and "tp" not in norm and all("part" not in p for p in norm["pieces"])
    c_attn = CheckpointReader(root / "tp2xdp2" / "gpt2").meta["params"]["transformer.h.0.attn.c_attn.weight"]
    assert c_attn["shape"] == [32, 96] and c_attn["tp"] == {"dim": 1, "parts": 2, "blocks": 3}


@pytest.mark.parametrize("kind", KINDS)
def test_consolidated_weights_are_the_engines_gathered_ones(runs, tmp_path, kind):
    root, saved, _ = runs
    assert cli.main(["to-fp32", str(root / "tp2xdp2" / kind), str(tmp_path)]) == 0
    weights = load_file(tmp_path / "model.safetensors")
    names = [n for n, _ in tp_models.build(kind).named_parameters()]  # each tied pair once
    assert sorted(weights) == sorted(names)
    for name in names:
        assert torch.equal(weights[name], saved[kind]["params"][name]), name
