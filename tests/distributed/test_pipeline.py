"""Pipeline parallelism (shardwise.pipe) on gloo ranks against the single-process oracle of
tests/pipeline_models.py. DeepSpeed's pipeline script (a PipelineModule of LayerSpecs, then train_batch) must
give the oracle's losses and final parameters: at 2 and 4 stages, with 2 data-parallel replicas and ZeRO 1/2 per
stage, clipped by the norm over every stage, with a layer tied across stages, under every schedule and partition
method and with activation checkpointing. Also: eval_batch, the loss on every rank, bf16/fp16 and the p2p traffic
(refusals: test_pipeline_errors.py).

Start-up is most of a spawned group's time, so one group (a module fixture) trains every configuration of its
world size, and the tests below read its results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests import pipeline_models as pm
from tests.harness import run_distributed
from tests.parity import assert_close_run

STEPS, MICRO, ACCUM = 4, 2, 4
CLIP = 1.0
"""Below the whole model's gradient norm at every step here (2 to 7): clipping acts at every step, so a norm
taken over one stage's gradients only would scale them differently and miss the oracle."""
LR = {"sgd": 0.05, "adamw": 1e-2}
LOW_PRECISION_RTOL = 2e-2
"""bf16 keeps 8 mantissa bits (fp16 11): each op rounds by up to ~2e-3 (~5e-4); over 4 steps the losses stay
within 3.2e-3 (bf16) and 4.5e-4 (fp16) of the fp32 oracle's here. 2e-2 leaves room and still catches a wrong
scale or a skipped step."""


@dataclass(frozen=True)
class Case:
    name: str
    stages: int
    parts: list[int]
    """The layer bounds the partition method must give (PipelineModule.partitions())."""
    optimizer: str = "sgd"
    clip: float = 0.0
    zero: int = 0
    blocks: int = 6
    tied: bool = False
    partition_method: str = "parameters"
    schedule: str = "1f1b"
    module: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    input_dtype: torch.dtype = torch.float32
    evaluate: bool = False

    @property
    def chunks(self) -> int:
        return self.module.get("num_chunks", 1)


FP32_TWO_RANKS = [
    Case("2 stages, sgd, clipped", 2, [0, 4, 8], clip=CLIP),
    Case("2 stages, adamw, zero-2", 2, [0, 4, 8], "adamw", zero=2),
    Case("2 stages, sgd, zero-2, clipped", 2, [0, 4, 8], clip=CLIP, zero=2),
    Case("2 stages, adamw, zero-1, clipped", 2, [0, 4, 8], "adamw", clip=CLIP, zero=1),
    Case("gpipe", 2, [0, 4, 8], schedule="gpipe"),
    Case("interleaved 1f1b, 2 chunks", 2, [0, 2, 4, 6, 8], clip=CLIP, schedule="interleaved_1f1b",
         module={"num_chunks": 2}),
    Case("uniform partition", 2, [0, 4, 7], blocks=5, partition_method="uniform"),  # by parameters: [0, 3, 7]
    Case("activation checkpointing", 2, [0, 4, 8], clip=CLIP, module={"activation_checkpoint_interval": 2}),
    Case("tied, 2 stages, clipped", 2, [0, 4, 8], clip=CLIP, tied=True),
]
FP32_FOUR_RANKS = [
    Case("4 stages, sgd, clipped", 4, [0, 2, 4, 6, 8], clip=CLIP),
    Case("interleaved 1f1b, 4 stages, 2 chunks", 4, list(range(9)), clip=CLIP, schedule="interleaved_1f1b",
         module={"num_chunks": 2}),
    Case("type:block partition, 4 stages", 4, [0, 3, 5, 7, 8], partition_method="type:block"),  # uniform: 2 each
    Case("2 stages x 2 replicas, adamw, zero-1, clipped", 2, [0, 4, 8], "adamw", clip=CLIP, zero=1),
    Case("2 stages x 2 replicas, sgd, zero-2, clipped", 2, [0, 4, 8], clip=CLIP, zero=2, evaluate=True),
    Case("tied, 2 stages x 2 replicas, zero-1, clipped", 2, [0, 4, 8], clip=CLIP, zero=1, tied=True),
]
LOW_PRECISION = [
    Case("bf16", 2, [0, 4, 8], config={"bf16": {"enabled": True}}, input_dtype=torch.bfloat16),
    Case("fp16", 2, [0, 4, 8], clip=CLIP,
         config={"fp16": {"enabled": True, "initial_scale_power": 8, "auto_cast": True}}),
    # 2^16: the first batch's gradients overflow fp16 on the last stage only (asserted below)
    Case("fp16 overflow", 2, [0, 4, 8],
         config={"fp16": {"enabled": True, "initial_scale_power": 16, "hysteresis": 1, "auto_cast": True}}),
]
TWO_RANKS = FP32_TWO_RANKS + LOW_PRECISION


# --- on each rank ------------------------------------------------------------------------------------
def _sweep(cases: list[Case]) -> dict[str, dict[str, Any]]:
    return {case.name: _train(case) for case in cases}


def _train(case: Case) -> dict[str, Any]:
    config = pm.pipe_config(MICRO, ACCUM, LR[case.optimizer], clip=case.clip, optimizer=case.optimizer,
                            zero_optimization={"stage": case.zero}, pipeline={"schedule": case.schedule},
                            collective_timeout_s=30, **case.config)  # a stage left waiting fails, not hangs
    engine = pm.pipe_run(case.stages, config, 0, blocks=case.blocks, tied=case.tied,
                         partition_method=case.partition_method, **case.module)["engine"]
    forwards, blocks_here = _count_block_forwards(engine.module)
    norms = _record_stage_norms(engine)
    losses = [engine.train_batch(_data(engine, step, case)).item() for step in range(STEPS)]
    dp_rank, dp = _dp(engine)
    result = {"losses": losses, "params": _params(engine), "stage": engine.stage_id, "dp": dp,
              "dp_rank": dp_rank, "parts": engine.module.partitions(), "forwards": forwards[0],
              "blocks_here": blocks_here, "sends": engine.comm.stats.calls("send", "pipe"),
              "recvs": engine.comm.stats.calls("recv", "pipe"), "stage_norms": norms,
              "skipped": engine.skipped_steps, "loss_scale": engine.loss_scale,
              "tied_copy": _tied_copy(engine) if case.tied else None}
    if case.evaluate:
        result["eval"] = _evaluate(engine, case)
    return result


def _dp(engine: Any) -> tuple[int, int]:
    return engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()


def _data(engine: Any, step: int, case: Case):
    dp_rank, dp = _dp(engine)
    for x, y in pm.micro_batches(step, MICRO, ACCUM, dp_rank, dp, case.tied):
        yield x.to(case.input_dtype), y


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _count_block_forwards(module: torch.nn.Module) -> tuple[list[int], int]:
    """Forwards started by this stage's Blocks (a recomputed one counts again), and how many Blocks it has. A
    pre-hook: checkpoint's recomputation stops once it has what backward needs, before a segment's last Block
    returns."""
    count = [0]
    blocks = [m for m in module.modules() if isinstance(m, pm.Block)]
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count, len(blocks)


def _record_stage_norms(engine: Any) -> list[float]:
    """This stage's own gradient norm at each step (the engine adds the other stages' to it)."""
    norms, own = [], engine.strategy.grad_norm

    def grad_norm() -> torch.Tensor:
        norm = own()
        norms.append(float(norm))
        return norm

    engine.strategy.grad_norm = grad_norm
    return norms


def _tied_copy(engine: Any) -> dict[str, Any]:
    module = engine.module
    if "embed" not in module.tied_modules:
        return {"here": False}
    weight = module.tied_tensors("embed")[0]
    return {"here": True, "owner": module.owns_tied("embed"), "is_parameter": isinstance(weight, torch.nn.Parameter),
            "requires_grad": weight.requires_grad, "value": weight.detach().float().clone()}


def _evaluate(engine: Any, case: Case) -> dict[str, Any]:
    """eval_batch on step STEPS's batch (the oracle's next loss), then train_batch on the same batch."""
    before = _params(engine)
    loss, logits = engine.eval_batch(_data(engine, STEPS, case), return_logits=True)
    plain = engine.eval_batch(_data(engine, STEPS, case))
    unchanged = all(torch.equal(p, before[n]) for n, p in _params(engine).items())
    trained = engine.train_batch(_data(engine, STEPS, case)).item()
    return {"loss": loss.item(), "plain": plain.item(), "logits": logits, "unchanged": unchanged, "trained": trained}


# --- the spawned groups --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_sweep, 2, TWO_RANKS, timeout=300)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_sweep, 4, FP32_FOUR_RANKS, timeout=300)


def _runs(per_rank: list[dict[str, dict[str, Any]]], case: Case) -> list[dict[str, Any]]:
    return [results[case.name] for results in per_rank]


def _pipeline_names(blocks: int, tied: bool) -> list[str]:
    """The pipeline's name of each oracle parameter, in the oracle's order: "3.fc.weight",
    "tied_modules.embed.weight"."""
    from shardwise.pipe import TiedLayerSpec

    names, seen = [], set()
    for index, spec in enumerate(pm.layer_specs(blocks, tied)):
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue  # the oracle shares the first one's module
            seen.add(spec.key)
            prefix = f"tied_modules.{spec.key}"
        else:
            prefix = str(index)
        with torch.device("meta"):
            names += [f"{prefix}.{name}" for name, _ in spec.build().named_parameters()]
    return names


def _gathered(runs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every stage's parameters, each from one stage only; every data-parallel replica holds the same."""
    gathered: dict[str, torch.Tensor] = {}
    first_replica = {run["stage"]: run["params"] for run in runs if run["dp_rank"] == 0}
    for stage, params in sorted(first_replica.items()):
        assert not set(gathered) & set(params), f"stage {stage} holds parameters of another stage"
        gathered.update(params)
    for run in runs:
        replica0 = first_replica[run["stage"]]
        assert run["params"].keys() == replica0.keys()
        assert all(torch.equal(p, replica0[n]) for n, p in run["params"].items()), "replicas differ"
    return gathered


def _oracle(case: Case, dp: int, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, params = pm.oracle_run(steps, MICRO * ACCUM * dp, LR[case.optimizer], case.clip, case.blocks, case.tied,
                                   case.optimizer)
    names = _pipeline_names(case.blocks, case.tied)
    assert len(names) == len(params)
    return losses, dict(zip(names, params.values()))


def _assert_matches_oracle(case: Case, runs: list[dict[str, Any]]) -> None:
    assert len(runs) == case.stages * runs[0]["dp"]
    assert [run["losses"] for run in runs] == [runs[0]["losses"]] * len(runs), "ranks report different losses"
    assert all(run["parts"] == case.parts for run in runs)
    ref_losses, ref_params = _oracle(case, runs[0]["dp"])
    gathered = _gathered(runs)
    assert sorted(gathered) == sorted(ref_params)
    assert len(runs[0]["losses"]) == STEPS
    assert_close_run(runs[0]["losses"], gathered, ref_losses, ref_params, rtol=1e-5)


# --- fp32 parity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", FP32_TWO_RANKS, ids=lambda c: c.name)
def test_two_ranks_train_like_the_oracle(two_ranks, case):
    _assert_matches_oracle(case, _runs(two_ranks, case))


@pytest.mark.parametrize("case", FP32_FOUR_RANKS, ids=lambda c: c.name)
def test_four_ranks_train_like_the_oracle(four_ranks, case):
    _assert_matches_oracle(case, _runs(four_ranks, case))


def test_the_clipped_cases_would_miss_the_oracle_with_a_per_stage_norm(two_ranks):
    # each stage's own norm is above CLIP and below the whole model's: its own clip factor would be larger
    case = FP32_TWO_RANKS[0]
    stage_norms = [run["stage_norms"] for run in _runs(two_ranks, case)]
    for step in range(STEPS):
        whole = math.sqrt(sum(norms[step] ** 2 for norms in stage_norms))
        assert all(CLIP < norms[step] < whole for norms in stage_norms)


def test_a_tied_weight_is_a_parameter_on_its_owner_only(two_ranks, four_ranks):
    for per_rank, case in ((two_ranks, FP32_TWO_RANKS[-1]), (four_ranks, FP32_FOUR_RANKS[-1])):
        runs = _runs(per_rank, case)
        for run in runs:
            copy = run["tied_copy"]
            assert copy["here"] and copy["owner"] == (run["stage"] == 0)
            assert copy["is_parameter"] == copy["owner"]
            assert ("tied_modules.embed.weight" in run["params"]) == copy["owner"]
            assert copy["requires_grad"]  # the last stage's copy still needs its gradient, to send it
        owner = next(run for run in runs if run["stage"] == 0 and run["dp_rank"] == 0)
        for run in runs:  # every user computes with the owner's updated weight
            assert torch.equal(run["tied_copy"]["value"], owner["params"]["tied_modules.embed.weight"])


def test_activation_checkpointing_recomputes_each_forward(two_ranks):
    for case in FP32_TWO_RANKS:
        recomputed = 2 if case.module.get("activation_checkpoint_interval") else 1
        for run in _runs(two_ranks, case):
            assert run["blocks_here"] > 0
            assert run["forwards"] == recomputed * run["blocks_here"] * ACCUM * STEPS, case.name


# --- the loss on every rank, eval_batch ------------------------------------------------------------------
def test_eval_batch_gives_the_oracles_loss_on_every_rank_and_leaves_the_weights(four_ranks):
    case = next(c for c in FP32_FOUR_RANKS if c.evaluate)
    runs = _runs(four_ranks, case)
    ref_losses, _ = _oracle(case, 2, STEPS + 1)  # loss STEPS: the weights after STEPS steps, batch STEPS
    for run in runs:
        evaluated = run["eval"]
        assert evaluated["unchanged"]
        assert evaluated["loss"] == evaluated["plain"] == evaluated["trained"]  # train_batch saw the same weights
        assert evaluated["loss"] == pytest.approx(ref_losses[STEPS], rel=1e-5)


def test_eval_batch_return_logits_gives_the_last_stages_output(four_ranks):
    case = next(c for c in FP32_FOUR_RANKS if c.evaluate)
    _, ref_params = _oracle(case, 2)
    oracle = pm.Oracle(pm.layer_specs(case.blocks, case.tied))
    with torch.no_grad():
        for p, ref in zip(oracle.parameters(), ref_params.values()):
            p.copy_(ref)
    for run in _runs(four_ranks, case):
        logits = run["eval"]["logits"]
        if run["stage"] < case.stages - 1:
            assert logits is None
            continue
        *_, (x, _) = pm.micro_batches(STEPS, MICRO, ACCUM, run["dp_rank"], 2)  # this replica's last micro-batch
        torch.testing.assert_close(logits, oracle(x).detach(), rtol=1e-5, atol=1e-6)


# --- bf16 / fp16 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", LOW_PRECISION[:2], ids=lambda c: c.name)
def test_low_precision_losses_follow_the_fp32_oracle(two_ranks, case):
    runs = _runs(two_ranks, case)
    ref_losses, _ = _oracle(case, 1)
    assert [run["losses"] for run in runs] == [runs[0]["losses"]] * 2
    assert all(run["skipped"] == 0 for run in runs)
    for loss, ref in zip(runs[0]["losses"], ref_losses, strict=True):
        assert loss == pytest.approx(ref, rel=LOW_PRECISION_RTOL)


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(two_ranks):
    case = LOW_PRECISION[2]
    first, last = sorted(_runs(two_ranks, case), key=lambda run: run["stage"])
    # the premise: at the first step only the last stage's gradients overflow
    assert math.isfinite(first["stage_norms"][0]) and not math.isfinite(last["stage_norms"][0])
    assert all(math.isfinite(norm) for run in (first, last) for norm in run["stage_norms"][1:])
    assert first["skipped"] == last["skipped"] == 1
    assert first["loss_scale"] == last["loss_scale"] == 2.0 ** 15
    # the skipped step left every stage's weights as they were: step 1 runs from the initial weights
    oracle = pm.Oracle(pm.layer_specs())  # the initial weights
    x, y = pm.global_batch(1, MICRO * ACCUM)
    assert first["losses"][1] == pytest.approx(pm.loss_fn(oracle(x), y).item(), rel=LOW_PRECISION_RTOL)
    assert all(math.isfinite(loss) for loss in first["losses"])


# --- traffic between stages -----------------------------------------------------------------------------------
def _expected_p2p(stage: int, stages: int, tied: bool) -> tuple[int, int]:
    """1F1B and GPipe: per micro-batch one activation forward and one gradient back across each boundary, and
    the activation's description once, ahead of the first. A tied layer on the first and last stage adds the
    weight from the owner (at start and after each step) and the last stage's gradient to it (each batch)."""
    payloads = STEPS * ACCUM
    sends = (stage < stages - 1) * (payloads + 1) + (stage > 0) * payloads
    recvs = (stage > 0) * (payloads + 1) + (stage < stages - 1) * payloads
    if tied and stage == 0:
        sends, recvs = sends + 1 + STEPS, recvs + STEPS
    elif tied and stage == stages - 1:
        sends, recvs = sends + STEPS, recvs + 1 + STEPS
    return sends, recvs


def test_p2p_sends_and_receives_are_counted_on_the_pipe_group(two_ranks, four_ranks):
    for per_rank, cases in ((two_ranks, TWO_RANKS), (four_ranks, FP32_FOUR_RANKS)):
        for case in cases:
            if case.chunks > 1:
                continue
            for run in _runs(per_rank, case):
                assert (run["sends"], run["recvs"]) == _expected_p2p(run["stage"], case.stages, case.tied), case.name
