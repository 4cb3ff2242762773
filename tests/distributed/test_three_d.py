"""3D parallelism: pipeline x tensor x data. A tiny Megatron-style GPT written as a PipelineModule of
shardwise.tensor_parallel.layers (tests/pipeline_models.py), split by `tensor_parallel.autotp_size` with no
plan, trains as the single-process oracle does: losses and final whole parameters (each split parameter
reassembled from its tensor-parallel parts), at tp2 x pp2 x dp2 with ZeRO-1 and AdamW and at tp2 x pp2 with
ZeRO-2 and SGD,
clipped by the norm over every stage and tensor-parallel rank. A checkpoint taken at tp2 x pp2 x dp2 resumes
as a plain data-parallel run (one stage, no tensor parallelism) on the oracle's losses.

World 8 is slow on a small machine: one spawned group at world 8 (a module fixture) trains, saves and answers
the grid's questions; the tests read its results.
"""

from __future__ import annotations

import pytest
import torch

from tests import pipeline_models as pm
from tests.harness import run_distributed
from tests.parity import oracle_step

STEPS_BEFORE, STEPS_AFTER = 3, 2
MICRO, ACCUM, LR = 2, 2, 1e-2
CLIP = 0.5
"""Below the whole GPT's gradient norm at every step here (0.69 to 0.73 under AdamW, 0.95 to 1.05 under SGD): clipping acts each step, so a norm
missing a stage's or a tensor-parallel rank's part would scale the step differently and miss the oracle."""
RTOL = ATOL = 1e-5
"""fp32 (as tests/parity.assert_close_run): the orders of summation differ (tensor-parallel partial sums, per
micro-batch reductions), so parameters near zero get an absolute bound too."""
SGD_LR = 0.05


def _config(tp: int, zero: int, optimizer: str) -> dict:
    extra = {"tensor_parallel": {"autotp_size": tp}} if tp else {}
    lr = LR if optimizer == "adamw" else SGD_LR
    return pm.pipe_config(MICRO, ACCUM, lr, clip=CLIP, optimizer=optimizer, zero_optimization={"stage": zero}, **extra)


def _train(stages: int, tp: int, zero: int, start: int, steps: int, save_dir: str | None = None,
           load_dir: str | None = None, optimizer: str = "adamw") -> dict:
    import shardwise
    from shardwise.pipe import PipelineModule

    module = PipelineModule(pm.gpt_specs(), num_stages=stages, loss_fn=pm.gpt_loss, seed_layers=True,
                            base_seed=pm.BASE_SEED, partition_method="uniform")
    engine, *_ = shardwise.initialize(model=module, model_parameters=module.parameters(), config=_config(tp, zero, optimizer))
    if load_dir:
        engine.load_checkpoint(load_dir)
    grid = engine.grid
    dp, dp_rank = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    losses = [engine.train_batch(iter(pm.gpt_micro_batches(s, MICRO, ACCUM, dp_rank, dp))).item()
              for s in range(start, start + steps)]
    if save_dir:
        engine.save_checkpoint(save_dir)
    return {"losses": losses, "grid": _grid_answers(grid),
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "shards": {n: (s.dim, s.blocks) for n, s in engine.tensor_shards.items()}}


def _grid_answers(grid) -> dict:
    import torch.distributed as dist

    from shardwise.distributed import groups  # deepspeed.utils.groups

    return {"groups_getters": (groups.get_tensor_model_parallel_rank(), groups.get_tensor_model_parallel_world_size(),
                               groups.get_tensor_model_parallel_src_rank(), groups.get_data_parallel_rank(),
                               groups.get_data_parallel_world_size(), groups.get_model_parallel_world_size(),
                               dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
                               dist.get_process_group_ranks(groups.get_data_parallel_group())),
            "stage": grid.get_stage_id(), "data": grid.get_data_parallel_rank(),
            "tensor": (grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size(),
                       grid.get_tensor_model_parallel_rank(), grid.get_tensor_model_parallel_world_size()),
            "model": (grid.get_model_parallel_rank(), grid.get_model_parallel_world_size()),
            "groups": {name: dist.get_process_group_ranks(group) for name, group in (
                ("model", grid.get_model_parallel_group()), ("slice", grid.get_slice_parallel_group()),
                ("pipe", grid.get_pipe_parallel_group()), ("data", grid.get_data_parallel_group()))},
            "model_rank_in_group": dist.get_rank(grid.get_model_parallel_group()),
            "stage_to_global": [grid.stage_to_global(s) for s in range(grid.get_pipe_parallel_world_size())],
            "topology": (grid.topology().get_axis_names(), grid.topology().get_coord(dist.get_rank()))}


def _whole_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter at its whole shape: split ones assembled from data replica 0's tensor-parallel parts (in
    tensor rank order); whole ones must be the same on every tensor-parallel rank."""
    from shardwise.tensor_parallel import assemble

    whole: dict[str, torch.Tensor] = {}
    replica = sorted((r for r in results if r["grid"]["data"] == 0), key=lambda r: r["grid"]["tensor"][0])
    for name in {n for r in replica for n in r["params"]}:
        holders = [r for r in replica if name in r["params"]]
        if name in holders[0]["shards"]:
            dim, blocks = holders[0]["shards"][name]
            whole[name] = assemble([r["params"][name] for r in holders], dim, blocks)
        else:
            for r in holders[1:]:
                torch.testing.assert_close(r["params"][name], holders[0]["params"][name], rtol=0, atol=0)
            whole[name] = holders[0]["params"][name]
    return whole


@pytest.fixture(scope="module")
def three_d(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("three_d"))
    results = run_distributed(_train, 8, 2, 2, 1, 0, STEPS_BEFORE, save_dir, timeout=300)
    return results, save_dir


def _assert_matches_oracle(results: list[dict], ref_losses: list[float], ref_params: dict) -> None:
    """Every rank's losses, and the whole parameters assembled from every rank's shards, equal the oracle's."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["losses"], ref_losses, rtol=RTOL, atol=0, msg=lambda m: f"rank {rank}: {m}")
    whole = _whole_params(results)
    assert sorted(whole) == sorted(ref_params)
    for name, value in whole.items():
        torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def oracle():
    return pm.gpt_oracle_run(STEPS_BEFORE + STEPS_AFTER, MICRO * ACCUM * 2, LR, CLIP)


def test_tp2_pp2_dp2_zero1_matches_the_oracle(three_d):
    results, _ = three_d
    ref_losses, ref_params = pm.gpt_oracle_run(STEPS_BEFORE, MICRO * ACCUM * 2, LR, CLIP)
    _assert_matches_oracle(results, ref_losses, ref_params)
    split = set(results[0]["shards"]) | set(results[-1]["shards"])
    assert {"0.tokens.weight", "1.qkv.weight", "1.fc2.weight", "3.lm_head.weight"} <= split  # the 3D run split them
    assert "1.ln1.weight" not in split and "0.positions.weight" not in split


def test_tp2_pp2_dp2_grid_answers_the_tensor_axis(three_d):
    results, _ = three_d
    # mesh pipe x data x tensor, tensor fastest: rank = (stage * 2 + data) * 2 + tensor
    for rank, r in enumerate(results):
        g = r["grid"]
        stage, data, tensor = rank // 4, rank // 2 % 2, rank % 2
        assert (g["stage"], g["data"], g["tensor"]) == (stage, data, (tensor, 2, tensor, 2))
        assert g["model"] == (stage * 2 + tensor, 4) and g["model_rank_in_group"] == stage * 2 + tensor
        assert g["groups"] == {"model": sorted({data * 2 + t + 4 * s for s in (0, 1) for t in (0, 1)}),
                               "slice": [rank - tensor, rank - tensor + 1],
                               "pipe": [data * 2 + tensor, 4 + data * 2 + tensor],
                               "data": [stage * 4 + tensor, stage * 4 + 2 + tensor]}
        assert g["stage_to_global"] == g["groups"]["pipe"]
        assert g["topology"] == (["pipe", "data", "model"], {"pipe": stage, "data": data, "model": tensor})
        # deepspeed.utils.groups: "model parallel" there is the tensor axis, as in DeepSpeed 0.19.8
        assert g["groups_getters"] == (tensor, 2, rank - tensor, data, 2, 2, g["groups"]["slice"], g["groups"]["data"])


def test_tp2_pp2_dp2_checkpoint_resumes_at_tp1_pp1_dp2(three_d, oracle):
    _, save_dir = three_d
    ref_losses, ref_params = oracle
    resumed = run_distributed(_train, 2, 1, 0, 1, STEPS_BEFORE, STEPS_AFTER, None, save_dir, timeout=180)
    for rank, r in enumerate(resumed):
        assert r["shards"] == {}  # one stage, no tensor parallelism: every parameter whole
        torch.testing.assert_close(r["losses"], ref_losses[STEPS_BEFORE:], rtol=RTOL, atol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_tp2_pp2_zero2_sgd_matches_the_oracle():
    # SGD here: ZeRO-2 reduces each micro-batch's gradients apart, and AdamW's first steps are ~lr * sign(grad)
    # for a gradient near its eps (one qkv element's is 3.5e-8 at step 0), so a rounding difference there moves
    # that element by 1.5e-5: the optimizer's conditioning, not the parallelism (the world-8 run checks AdamW)
    results = run_distributed(_train, 4, 2, 2, 2, 0, STEPS_BEFORE, optimizer="sgd", timeout=180)
    ref_losses, ref_params = pm.gpt_oracle_run(STEPS_BEFORE, MICRO * ACCUM, SGD_LR, CLIP, optimizer="sgd")
    _assert_matches_oracle(results, ref_losses, ref_params)
    # two stages of one replica, no data parallelism: the model group is the whole world
    assert all(r["grid"]["groups"]["model"] == [0, 1, 2, 3] for r in results)


def _mixed(steps: int) -> list[float]:
    """A pipeline whose first stage has nothing to split (plain layers) and whose last has a tensor-parallel head."""
    import shardwise
    from shardwise.pipe import PipelineModule

    module = PipelineModule(_mixed_specs(), num_stages=2, loss_fn=pm.loss_fn, seed_layers=True, base_seed=pm.BASE_SEED,
                            partition_method="uniform")
    engine, *_ = shardwise.initialize(model=module, model_parameters=module.parameters(),
                                      config={**_config(2, 1, "sgd"), "gradient_clipping": 0.0})
    assert len(engine.tensor_shards) == (0 if engine.stage_id == 0 else 2)  # the head's weight and bias
    return [engine.train_batch(iter(pm.micro_batches(s, MICRO, ACCUM, 0, 1))).item() for s in range(steps)]


def _mixed_specs() -> list:
    from shardwise.pipe import LayerSpec
    from shardwise.tensor_parallel import ColumnParallelLinear

    return [*pm.layer_specs(blocks=1)[:-1], LayerSpec(torch.nn.Tanh),
            LayerSpec(ColumnParallelLinear, pm.WIDTH, pm.OUT, gather_output=True)]


def test_a_stage_with_nothing_to_split_trains_beside_one_that_has():
    losses = run_distributed(_mixed, 4, 2, timeout=180)
    model = pm.Oracle(_mixed_specs())
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    ref = [oracle_step(model, opt, pm.loss_fn(model(x), y), 0.0)
           for x, y in (pm.global_batch(s, MICRO * ACCUM) for s in range(2))]
    for rank, got in enumerate(losses):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=0, msg=lambda m: f"rank {rank}: {m}")


def _nothing_to_split() -> str:
    import shardwise
    from shardwise.pipe import PipelineModule
    from shardwise.tensor_parallel import TensorParallelError

    module = PipelineModule(pm.layer_specs(blocks=1), num_stages=1, loss_fn=pm.loss_fn)
    with pytest.raises(TensorParallelError) as info:
        shardwise.initialize(model=module, model_parameters=module.parameters(), config=_config(2, 0, "sgd"))
    return str(info.value)


def test_a_pipeline_with_nothing_to_split_is_refused_on_every_rank():
    messages = run_distributed(_nothing_to_split, 2, timeout=120)
    assert messages[0] == messages[1] == (
        "tensor_parallel.autotp_size: no stage of the PipelineModule has a module to split, so every tensor-parallel "
        "rank would compute the same thing; build its layers with shardwise.tensor_parallel.layers "
        "(ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding), give "
        "tensor_parallel.partition_config.layer_specs, or set autotp_size to 1.")
