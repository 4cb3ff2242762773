"""Resuming under another batch layout continues the uninterrupted run.

A run saves, and a run with another data-parallel size, micro-batch × gradient_accumulation_steps split or
ZeRO stage loads and trains on (the same global batch). Each case compares every step's loss and the final
parameters with one single-process run over the same samples, and the sample indices each rank read with
torch's DistributedSampler at the resuming layout (the samples an uninterrupted run at that layout reads
from the same place on). Found by a probe: the saved `micro_steps` put the accumulation boundaries in the
wrong place (steps spanning two global batches), and the loader resumed by batches per rank, not samples,
so it read some samples twice and others never.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

import shardwise
from shardwise.runtime.data import RepeatingLoader
from tests.harness import run_distributed
from tests.parity import (SEQ, VOCAB, assert_close_run, ds_config, full_state_dict, make_model, oracle, param_groups,
                          train_steps)

N = 40  # samples per epoch: a multiple of the global batch (8), so the steps of every layout tile an epoch


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.arange(N), torch.randint(0, VOCAB, (N, SEQ), generator=g),
                         torch.randint(0, VOCAB, (N, SEQ), generator=g))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _phase(root: str, layout: tuple, steps: int, load: bool, extra_micro_steps: int = 0) -> dict:
    """On each rank: build the engine at `layout` (micro, gas, stage), load `root` if asked, train `steps`
    steps from the built-in loader, then `extra_micro_steps` more micro-steps, and save to `root`."""
    micro, gas, stage = layout
    warnings = _Warnings()
    logging.getLogger("shardwise").addHandler(warnings)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    model = make_model()
    shardwise.zero.register_external_parameter(model, model.embed.weight)
    engine, _, loader, _ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                                training_data=_dataset(), config=ds_config(micro, gas, zero_optimization=zero))
    if load:
        engine.load_checkpoint(root)
    batches, losses, read = RepeatingLoader(loader), [], []
    for step in range(steps + (1 if extra_micro_steps else 0)):
        total = torch.zeros(())
        for _ in range(gas if step < steps else extra_micro_steps):
            ids, tokens, labels = next(batches)
            read.extend(ids.tolist())
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        if step < steps:
            losses.append(total.item() / (gas * dist.get_world_size()))
    engine.save_checkpoint(root)
    read_by_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(read_by_rank, read)
    params = {k: v.float() for k, v in full_state_dict(engine).items()}
    return dict(losses=losses, read=read_by_rank, params=params, warnings=warnings.lines,
                global_steps=engine.global_steps)


def _stream(world: int, rank: int, epoch: int, position: int, count: int) -> list[int]:
    """`count` indices rank `rank` of `world` reads from `position` of `epoch` on, by torch's DistributedSampler
    (a position that `world` divides: there an uninterrupted run at `world` is at that same place)."""
    assert position % world == 0
    out: list[int] = []
    while len(out) < count:
        sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        out += list(sampler)[position // world:]
        epoch, position = epoch + 1, 0
    return out[:count]


def _oracle(batches: list[list[int]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, one step per batch of sample indices: the losses and parameters to match."""
    _, tokens, labels = _dataset().tensors
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    losses = []
    for ids in batches:
        loss = model(tokens[ids], labels[ids])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(root, phases: list[tuple]) -> tuple[list[float], list[list[int]], list[dict]]:
    """Run the phases (world, (micro, gas, stage), steps), each resuming from the one before; check what every
    rank read; return the losses, the batch of each step (all ranks together) and the phases' results."""
    losses, batches, results, position = [], [], [], 0
    for i, (world, layout, steps, *extra) in enumerate(phases):
        result = run_distributed(_phase, world, str(root), layout, steps, i > 0, *extra, timeout=300)[0]
        micro, gas, _ = layout
        per_rank = steps * gas * micro + (extra[0] * micro if extra else 0)
        epoch, at = divmod(position, N)
        expected = [_stream(world, r, epoch, at, per_rank) for r in range(world)]
        assert result["read"] == expected, f"phase {i}: the samples read differ from the uninterrupted order"
        for step in range(steps):
            batch = slice(step * gas * micro, (step + 1) * gas * micro)
            batches.append([j for r in range(world) for j in expected[r][batch]])
        losses += result["losses"]
        results.append(result)
        position += per_rank * world
    return losses, batches, results


def _check(losses, batches, results, rtol=2e-5):
    ref_losses, ref_params = _oracle(batches)
    assert_close_run(losses, results[-1]["params"], ref_losses, ref_params, rtol=rtol)
    assert len(losses) == len(ref_losses)


def _epoch_slices(batches: list[list[int]], size: int) -> None:
    """The steps of the resumed runs read the global batches the single-process run reads: in order, the
    consecutive `size`-sample slices of each epoch's permutation."""
    for step, batch in enumerate(batches):
        epoch, at = divmod(step * size, N)
        sampler = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert Counter(batch) == Counter(order[at : at + size]), f"step {step}"


LAYOUTS = {  # (world, (micro, gradient_accumulation_steps, ZeRO stage), steps); global batch 8 throughout
    "dp2to1": [(2, (4, 1, 0), 3), (1, (4, 2, 0), 3)],
    "dp1to2": [(1, (2, 4, 2), 3), (2, (2, 2, 2), 3)],
    "micro4x1to2x2to1x4": [(2, (4, 1, 1), 3), (2, (2, 2, 1), 2), (2, (1, 4, 1), 3)],  # the third phase starts epoch 1
    "zero1to3_dp2to1": [(2, (2, 2, 1), 2), (1, (2, 4, 3), 3)],
    "zero3to0_dp2to4": [(2, (4, 1, 3), 3), (4, (1, 2, 0), 3)],
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_resume_at_another_layout_continues_the_uninterrupted_run(tmp_path, case):
    losses, batches, results = _run(tmp_path, LAYOUTS[case])
    _epoch_slices(batches, 8)
    _check(losses, batches, results)
    assert all(not r["warnings"] for r in results), [r["warnings"] for r in results]


def _steps(root: str, micro: int, gas: int, start: int, steps: int) -> dict:
    """Steps [start, start + steps) of tests.parity's batch sequence (no loader), resuming from `root` when
    start > 0, then a save."""
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                      config=ds_config(micro, gas, zero_optimization={"stage": 1}))
    if start:
        engine.load_checkpoint(root)
    losses = train_steps(engine, start, steps)
    engine.save_checkpoint(root)
    return dict(losses=losses, params=full_state_dict(engine),
                micro_steps=engine.micro_steps)


def test_a_new_micro_batch_and_accumulation_split_keeps_the_step_boundaries(tmp_path):
    """The probe's case, without a loader: saved at step 3 with micro 4 × gas 1, resumed with 2 × 2, then 1 × 4
    (2 ranks, global batch 8). The saved micro_steps (3) made the first resumed micro-batch a boundary."""
    runs = [run_distributed(_steps, 2, str(tmp_path), micro, gas, start, steps)[0]
            for micro, gas, start, steps in [(4, 1, 0, 3), (2, 2, 3, 2), (1, 4, 5, 2)]]
    ref_losses, ref_params = oracle(7, 8)
    assert_close_run([x for r in runs for x in r["losses"]], runs[-1]["params"], ref_losses, ref_params, rtol=2e-5)
    assert [r["micro_steps"] for r in runs] == [3, 3 * 2 + 2 * 2, 5 * 4 + 2 * 4]  # as if run in that layout from step 0


def test_dp2to3_where_the_epoch_is_padded(tmp_path):
    """40 samples over 3 ranks: the last round of epoch 0 repeats 2 of its first samples (DistributedSampler's
    padding at 3 ranks), and epoch 1 follows; global batch 12."""
    losses, batches, results = _run(tmp_path, [(2, (3, 2, 2), 2), (3, (2, 2, 2), 3)])
    _check(losses, batches, results)
    epoch0 = [j for ids in results[0]["read"] for j in ids] + [j for ids in results[1]["read"] for j in ids[:6]]
    first = list(DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=0))
    assert Counter(epoch0) == Counter(first + first[:2])  # every sample once, and the padding


def test_a_checkpoint_inside_an_accumulation_window_drops_the_window_with_a_warning(tmp_path):
    """Saved after 2 steps and 1 of the 2 micro-batches of step 3: its gradients are not in the checkpoint. The
    resumed run starts step 3 with a whole window of new samples; the dropped micro-batch's samples count as read."""
    losses, batches, results = _run(tmp_path, [(2, (2, 2, 0), 2, 1), (1, (2, 4, 0), 2)])
    _check(losses, batches, results)
    assert results[0]["warnings"] == [
        "save_checkpoint: saved inside a gradient accumulation window (1 of 2 micro-batches of step 3 accumulated); "
        "the checkpoint does not hold their gradients, so a run resumed from it drops them. Save right after the "
        "engine.step() that ends a window (is_gradient_accumulation_boundary() true before it) to resume exactly."]
    assert results[1]["warnings"] == [
        "load_checkpoint: the checkpoint was saved inside a gradient accumulation window (1 of 2 micro-batches of "
        "step 3 accumulated) and holds none of their gradients; they are dropped and step 3 starts a new window."]
    assert results[1]["global_steps"] == 4


def test_a_changed_global_batch_is_named_and_taken_up(tmp_path):
    losses, batches, results = _run(tmp_path, [(2, (2, 2, 0), 2), (2, (2, 4, 0), 1)])
    _check(losses, batches, results)
    assert [len(b) for b in batches] == [8, 8, 16]
    assert results[1]["warnings"] == [
        "load_checkpoint: train_batch_size is 16, the checkpoint was saved with 8; training goes on after step 2 (16 "
        "samples) with the new global batch, so it no longer follows the saved run (the learning rate schedule "
        "counts steps). Keep train_batch_size at 8 to continue that run exactly."]


def test_a_checkpoint_in_the_old_loader_format_resumes_with_a_warning(tmp_path):
    """Checkpoints saved before the epoch position was recorded keep `batches_seen` per rank; the saving layout in
    the manifest turns it into the position, so even a resume at another layout is exact, and it says so."""
    _, first_batches, first = _run(tmp_path, [(2, (4, 1, 0), 3)])
    manifest = tmp_path / "latest"
    manifest = tmp_path / manifest.read_text() / "manifest.json"
    meta = json.loads(manifest.read_text())
    meta["data_loader"] = {"epoch": 0, "batches_seen": 3}
    del meta["counters"]["window_micro_steps"]
    manifest.write_text(json.dumps(meta))
    second = run_distributed(_phase, 1, str(tmp_path), (4, 2, 0), 2, True)[0]
    assert second["read"] == [_stream(1, 0, 0, 24, 16)]
    batches = first_batches + [second["read"][0][:8], second["read"][0][8:]]
    _check(first[0]["losses"] + second["losses"], batches, [second])
    assert second["warnings"] == [
        "data_loader: the checkpoint counts batches read per rank (batches_seen=3, an older format), not samples "
        "consumed; taken as 3 × micro-batch 4 × 2 data-parallel ranks = 24 samples of epoch 0, exact only if the "
        "saving run's loader had that layout. Save a new checkpoint to record the position itself."]
