"""Pipeline checkpoints load at another pipeline degree, data-parallel size and ZeRO stage, and the run goes on
as the single-process oracle does; each stage's buffers are saved by that stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.pipeline_models import BASE_SEED, layer_specs, loss_fn, micro_batches, oracle_run, pipe_config

STEPS_BEFORE, STEPS_AFTER, GLOBAL_BATCH = 3, 2, 8


class Counter(torch.nn.Module):
    """Passes its input on and counts the training forwards in a buffer (state that lives on one stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
        return x


def _train(stages, config, start, steps, tied, save_dir, load, counter=False):
    import shardwise
    from shardwise.pipe import LayerSpec, PipelineModule

    specs = layer_specs(6, tied)
    if counter:
        specs = specs[:-1] + [LayerSpec(Counter), specs[-1]]
    module = PipelineModule(specs, num_stages=stages, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
                            partition_method="uniform")
    engine, *_ = shardwise.initialize(model=module, model_parameters=module.parameters(), config=config)
    if load:
        engine.load_checkpoint(save_dir)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp, rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    losses = [engine.train_batch(iter(micro_batches(s, micro, accum, rank, dp, tied))).item()
              for s in range(start, start + steps)]
    if not load:
        engine.save_checkpoint(save_dir)
    seen = [int(b) for n, b in engine.module.named_buffers() if n.endswith("seen")]
    return losses, engine.global_steps, seen


def _config(accum, zero):
    return pipe_config(2, accum, lr=0.05, clip=1.0, optimizer="adamw", zero_optimization={"stage": zero})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_two_stage_checkpoint_resumes_at_one_four_and_two_by_two(tied, tmp_path):
    ref, _ = oracle_run(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH, 0.05, clip=1.0, tied=tied, optimizer="adamw")
    first = run_distributed(_train, 2, 2, _config(4, 1), 0, STEPS_BEFORE, tied, tmp_path, False, timeout=180)
    torch.testing.assert_close(first[0][0], ref[:STEPS_BEFORE], rtol=1e-5, atol=0)
    # (stages, world, accumulation, ZeRO stage): micro-batch 2 x accumulation x data-parallel = 8 every time
    for stages, world, accum, zero in [(1, 1, 4, 0), (4, 4, 4, 2), (2, 4, 2, 1)]:
        resumed = run_distributed(_train, world, stages, _config(accum, zero), STEPS_BEFORE, STEPS_AFTER, tied,
                                  tmp_path, True, timeout=180)
        for losses, steps, _ in resumed:
            assert steps == STEPS_BEFORE + STEPS_AFTER
            torch.testing.assert_close(losses, ref[STEPS_BEFORE:], rtol=1e-5, atol=0,
                                       msg=lambda m: f"resumed at {stages} stages x {world // stages} ranks: {m}")


def test_each_stage_saves_its_own_buffers(tmp_path):
    run_distributed(_train, 2, 2, _config(4, 0), 0, 2, False, tmp_path, False, True, timeout=120)
    manifest = json.loads(next(Path(tmp_path).glob("global_step*/manifest.json")).read_text())
    counter = next(n for n in manifest["buffers"] if n.endswith("seen"))
    assert manifest["buffer_files"][counter] == "rank1.safetensors"  # the Counter sits on stage 1
    # read back at one stage, where the buffer's layer now lives on rank 0
    resumed = run_distributed(_train, 1, 1, _config(4, 0), 2, 1, False, tmp_path, True, True, timeout=120)
    assert resumed[0][2] == [2 * 4 + 4]  # 2 steps x 4 micro-batches saved, one more step after loading


def _save_16bit(save_dir):
    import shardwise
    from shardwise.pipe import PipelineError, PipelineModule

    module = PipelineModule(layer_specs(2), num_stages=2, loss_fn=loss_fn)
    engine, *_ = shardwise.initialize(model=module, model_parameters=module.parameters(), config=_config(4, 0))
    with pytest.raises(PipelineError, match="no rank has the whole model") as info:
        engine.save_16bit_model(save_dir)
    return str(info.value)


def test_whole_model_saves_are_refused_not_partial(tmp_path):
    messages = run_distributed(_save_16bit, 2, str(tmp_path), timeout=120)
    assert all("shardwise checkpoint to-fp32 <save_dir> <out_dir>" in m for m in messages)
    assert not list(tmp_path.iterdir())  # nothing half-written
