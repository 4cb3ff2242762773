"""random-LTD through shardwise.initialize at world 2: exact when it keeps everything (ZeRO 0 and 3), one dropping
step against the single-process oracle, exact resume, checkpoints shared with runs without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise
from tests.harness import run_distributed
from tests.parity import full_state_dict
from tests.random_ltd_models import SEQ, batch, ltd_section, oracle_loss, tiny

transformers = pytest.importorskip("transformers")

LR, MICRO = 0.1, 2


def _engine(kind: str, stage: int, data_efficiency: dict | None, gas: int = 1):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if data_efficiency is not None:
        config["data_efficiency"] = data_efficiency
    engine, *_ = shardwise.initialize(model=tiny(kind), config=config)
    return engine


def _train(engine, steps: int, first: int = 0) -> list[float]:
    rank, world, gas = dist.get_rank(), dist.get_world_size(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(first, first + steps):
        for micro in range(gas):
            ids = batch(step * gas + micro, MICRO * world)[rank * MICRO:(rank + 1) * MICRO]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
    return losses


def _keep_all_equals_plain(kind: str):
    out = {}
    for stage in (0, 3):
        keep_all = _engine(kind, stage, ltd_section([1, 2], SEQ, 2 * SEQ))
        assert keep_all.random_ltd_enabled() and len(keep_all.random_ltd_scheduler.layers) == 2
        plain = _engine(kind, stage, None)
        assert not plain.random_ltd_enabled()
        out[stage] = (_train(keep_all, 3), full_state_dict(keep_all), _train(plain, 3), full_state_dict(plain))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_keeping_every_token_equals_the_plain_model(kind):
    for stage, (losses, weights, plain_losses, plain_weights) in run_distributed(_keep_all_equals_plain, 2, kind,
                                                                                 timeout=300)[0].items():
        assert losses == pytest.approx(plain_losses, rel=1e-5), stage
        for name, value in plain_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=f"stage {stage}: {name}")


def _one_dropping_step(kind: str):
    engine = _engine(kind, 3, ltd_section([0, 2], 4, SEQ, require_steps=4, seq_per_step=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch(0, MICRO * world)[rank * MICRO:(rank + 1) * MICRO]
    loss = _train(engine, 1)[0]
    scheduler = engine.random_ltd_scheduler
    kept = {layer.layer_index: layer.draw(MICRO, SEQ, 4, torch.device("cpu")) for layer in scheduler.layers}
    oracle = tiny(kind)
    oracle_value = oracle_loss(kind, oracle, ids, kept)
    oracle_value.backward()
    with torch.no_grad():
        for param in oracle.parameters():
            dist.all_reduce(param.grad)
            param -= LR * param.grad / world
    total = oracle_value.detach().clone()
    dist.all_reduce(total)
    return loss, total.item() / world, full_state_dict(engine), oracle.state_dict(), scheduler.get_current_seq()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_dropping_step_matches_the_oracle(kind):
    loss, oracle_value, weights, oracle_weights, kept = run_distributed(_one_dropping_step, 2, kind, timeout=300)[0]
    assert kept == 4
    assert loss == pytest.approx(oracle_value, rel=1e-5)
    for name, value in oracle_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _resume(root: str):
    section = ltd_section([1, 3], 4, SEQ, require_steps=4, seq_per_step=2)
    whole = _engine("llama", 3, section, gas=2)
    whole_losses = _train(whole, 4)
    first = _engine("llama", 3, section, gas=2)
    losses = _train(first, 2)
    first.save_checkpoint(root)
    resumed = _engine("llama", 3, section, gas=2)
    resumed.load_checkpoint(root)
    losses += _train(resumed, 2, first=2)
    plain = _engine("llama", 0, None)
    plain.load_checkpoint(root, load_optimizer_states=False)  # a random-LTD checkpoint in a run without it
    return (whole_losses, full_state_dict(whole), losses, full_state_dict(resumed), full_state_dict(first),
            full_state_dict(plain), _train(_engine("llama", 3, None, gas=2), 4),
            resumed.random_ltd_scheduler.state_dict())


def test_resume_is_exact_and_checkpoints_load_without_random_ltd(tmp_path):
    (whole_losses, whole, losses, resumed, saved, plain, plain_losses,
     state) = run_distributed(_resume, 2, str(tmp_path), timeout=400)[0]
    assert losses == whole_losses  # bit for bit
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    assert whole_losses[2:] != pytest.approx(plain_losses[2:], rel=1e-4)  # tokens were dropped
    assert list(plain) == list(saved)
    for name, value in saved.items():
        assert torch.equal(plain[name], value), name
    assert state["current_steps"] == 3 and state["current_value"] == 10


class _TwoStacks(torch.nn.Module):
    """Two lists of blocks: which one random_ltd_layer_id indexes is ambiguous until the script names the class."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.front = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
        self.back = torch.nn.ModuleList([torch.nn.LayerNorm(16) for _ in range(3)])

    def forward(self, ids):
        h = self.embed(ids)
        for block in [*self.front, *self.back]:
            h = block(h)
        return h.pow(2).mean()


def _convert_after_initialize():
    from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "data_efficiency": ltd_section([2], 4, SEQ)}
    engine, *_ = shardwise.initialize(model=_TwoStacks(), config=config)
    ids = batch(0, 2)
    try:
        engine(ids)
        refused = None
    except ValueError as e:
        refused = str(e)
    assert convert_to_random_ltd(engine, torch.nn.LayerNorm) is engine
    seen = []
    engine.module.back[2].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    engine.module.back[2].weight.register_hook(lambda g: seen.append("grad"))
    engine.backward(engine(ids))
    engine.step()
    return refused, seen, engine.random_ltd_scheduler.total_layer_num


def test_convert_to_random_ltd_names_the_layers_after_initialize():
    refused, seen, layers = run_distributed(_convert_after_initialize, 1)[0]
    assert refused.startswith("random_ltd.random_ltd_layer_id: indexes the model's list of transformer layers, "
                              "which must be the one outermost nn.ModuleList of identical blocks in _TwoStacks; found "
                              "front (2 x Linear), back (3 x LayerNorm). Call deepspeed.runtime")
    assert seen == [(2, SEQ, 16), "grad"] and layers == 3
