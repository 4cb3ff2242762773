"""Ulysses sequence parallelism against the single-process full-sequence model (fp32, 1e-5): losses, clipped
gradient norms and final weights, on a LLaMA with grouped-query attention whose sequence slices hold different
numbers of labelled tokens (some none)."""

from __future__ import annotations

import pytest

from tests import ulysses_models as um
from tests.harness import run_distributed


@pytest.mark.parametrize("sp, world, stage", [
    (2, 2, 0),
    (4, 4, 3),  # 2 key/value heads over 4 ranks: each is replicated
    (2, 4, 2),  # sp 2 x dp 2
])
def test_ulysses_matches_the_full_sequence(sp, world, stage):
    want = um.oracle(sp, world)
    for got in run_distributed(um.run_case, world, sp, stage):
        assert got["exchanges"] > 0
        # 3 exchanges in, 1 out per layer and forward, the same back: all in the engine's comms log
        assert got["counted_all_to_alls"] == got["exchanges"] * 8, got
        um.assert_matches(got, want, label=f"sp={sp} world={world} stage={stage}")


def test_ulysses_beside_tensor_parallelism():
    """tp 2 x sp 2: each tensor rank's 2 query heads and 1 kv head are split again over its sequence peers."""
    want = um.oracle(2, 2)
    for got in run_distributed(um.run_case, 4, 2, 1, tp=2):
        assert got["counted_all_to_alls"] > 0
        um.assert_matches(got, want, label="tp 2 x sp 2")


def test_ulysses_with_lora_zero3_offload_and_checkpointing():
    want = um.oracle(2, 2, lora=True)
    for got in run_distributed(um.run_case, 2, 2, 3, lora=True, checkpointing=True,
                               zero={"offload_optimizer": {"device": "cpu"}}):
        um.assert_matches(got, want, label="lora zero-3 offload checkpointing")


@pytest.mark.parametrize("world", [1, 4])
def test_a_checkpoint_saved_at_sp2_resumes_at_another_size(tmp_path, world):
    """Saved at sp 2 (ZeRO-2), resumed at sp `world` (1: the whole sequence on one rank): the two halves of the run
    equal one oracle run of the same samples."""
    first = run_distributed(um.run_case, 2, 2, 2, steps=2, save=str(tmp_path))
    second = run_distributed(um.run_case, world, world, 2, steps=2, load=str(tmp_path))
    want = um.oracle(2, 2, plan=um.schedule(2, 2, 2) + um.schedule(world, world, 2))
    for got in first:
        um.assert_matches(got, {**want, "losses": want["losses"][:2], "norms": want["norms"][:2],
                                "params": got["params"]}, label="saved at sp 2")
    for got in second:
        um.assert_matches(got, {**want, "losses": want["losses"][2:], "norms": want["norms"][2:]},
                          label=f"resumed at sp {world}")


def _model_without_ulysses() -> str:
    import torch

    import shardwise
    from shardwise.sequence_parallel import SequenceParallelError

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))  # attention nowhere
    engine, *_ = shardwise.initialize(model=model, config=um.config(2, 0))
    try:
        engine(torch.zeros(1, 4, dtype=torch.long))
    except SequenceParallelError as e:
        return str(e)
    return "trained"


def test_a_model_whose_attention_never_reaches_ulysses_is_refused_at_its_first_forward():
    for message in run_distributed(_model_without_ulysses, 2):
        assert "no attention of the model went through Ulysses" in message


def test_ulysses_in_bf16_follows_the_fp32_run_within_bf16_resolution():
    want = um.oracle(2, 2)
    for got in run_distributed(um.run_case, 2, 2, 2, bf16={"enabled": True}):
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
            assert abs(a - b[0]) <= 2e-2 * abs(b[0]), f"bf16 step {step}: loss {a} vs fp32 oracle {b[0]}"


def _loader_from_initialize() -> dict:
    import torch

    import shardwise

    samples = [um.sample(i) for i in range(6)]

    def collate(batch):
        return {k: torch.cat([b[k] for b in batch]) for k in batch[0]}

    engine, _, loader, _ = shardwise.initialize(model=um.build(), config=um.config(2, 0), training_data=samples,
                                                collate_fn=collate)
    first = next(iter(loader))
    return {"length": len(loader), "ids": first["input_ids"], "labels": first["shift_labels"]}


def test_the_loader_initialize_returns_cuts_each_batch_along_the_sequence():
    """One sample per rank and batch: rank 0's first batch is sample s, cut in two over the ranks."""
    import torch

    results = run_distributed(_loader_from_initialize, 2)
    assert [r["length"] for r in results] == [6, 6]  # 3 batches per rank, each worked through in 2 iterations
    ids = torch.cat([r["ids"] for r in results], dim=1)
    matches = [i for i in range(6) if torch.equal(um.sample(i)["input_ids"], ids)]
    assert len(matches) == 1, "the two slices must be one sample's halves"
    whole = um.sample(matches[0])["labels"]
    torch.testing.assert_close(torch.cat([r["labels"] for r in results], dim=1)[:, :-1], whole[:, 1:])
