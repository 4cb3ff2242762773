"""The legacy seqlen curriculum through the engine at world 2: equal to a single-process oracle that cuts the
same batches by hand (ZeRO 0 and 3), the `curriculum_seqlen` kwarg for a model that takes it, and a resumed run
equal to the uninterrupted one bit for bit."""

from __future__ import annotations

import torch

from shardwise.data_efficiency import DifficultySchedule
from tests.harness import run_distributed
from tests.parity import (SEQ, assert_close_run, ds_config, full_state_dict, global_batch, make_model, oracle_step,
                          param_groups, train_steps)

LEGACY = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 2, "max_difficulty": SEQ,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 1}}
STEPS, MICRO, ACCUM, WORLD = 6, 2, 2, 2


def config(stage: int) -> dict:
    return ds_config(MICRO, ACCUM, curriculum_learning=LEGACY, zero_optimization={"stage": stage})


def cut_oracle(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from shardwise.config.data_efficiency import LegacyCurriculumConfig

    schedule = DifficultySchedule(LegacyCurriculumConfig(**LEGACY))
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    losses = []
    for step in range(steps):
        tokens, labels = global_batch(step, MICRO * ACCUM * WORLD)
        length = int(schedule.difficulty(step + 1))
        losses.append(oracle_step(model, opt, model(tokens[:, :length], labels[:, :length]), 0.0))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(stage: int) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    import shardwise

    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config(stage))
    losses = train_steps(engine, 0, STEPS)
    seen = [engine.curriculum_scheduler_legacy.get_current_difficulty(), engine.curriculum_enabled_legacy(),
            engine.curriculum_params_legacy()["min_difficulty"]]
    engine.eval()  # eval: the whole sequence
    tokens, labels = global_batch(99, 2)
    eval_loss = engine(tokens, labels).item()
    return losses, {k: v.float() for k, v in full_state_dict(engine).items()}, [*seen, eval_loss]


def test_legacy_seqlen_equals_an_oracle_cutting_by_hand() -> None:
    ref_losses, ref_params = cut_oracle(STEPS)
    full_losses = cut_oracle_uncut()
    for stage in (0, 3):
        losses, params, seen = run_distributed(_train, WORLD, stage)[0]
        assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)
        assert seen[:3] == [SEQ, True, 2]
        model = make_model()
        model.load_state_dict(ref_params)
        assert abs(seen[3] - model(*global_batch(99, 2)).item()) < 1e-5
    assert abs(full_losses[1] - ref_losses[1]) > 1e-3  # the cut matters: whole sequences give another loss


def cut_oracle_uncut() -> list[float]:
    from tests.parity import oracle

    return oracle(2, MICRO * ACCUM * WORLD)[0]


class KwargModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()
        self.lengths: list[int] = []

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.lengths.append(curriculum_seqlen)
        return self.inner(tokens[:, :curriculum_seqlen], labels[:, :curriculum_seqlen])


def _kwarg() -> tuple[list[int], str]:
    import shardwise

    model = KwargModel()
    engine, _, _, _ = shardwise.initialize(model=model, config=config(0))
    train_steps(engine, 0, 3)
    try:
        engine.set_data_post_process_func(lambda batch, state: batch)
    except ValueError as e:
        return model.lengths, str(e)
    return model.lengths, ""


def test_a_model_taking_curriculum_seqlen_gets_it() -> None:
    lengths, refusal = run_distributed(_kwarg, WORLD)[0]
    assert lengths == [2, 2, 3, 3, 4, 4]  # steps 1, 2, 3; two micro-batches each
    # without the data-sampling curriculum nothing would apply a post-process function: refused, not ignored
    assert refusal.startswith("set_data_post_process_func: the function is applied by the data-sampling "
                              "curriculum's loader, which is off")


def _run(root: str, start: int, steps: int, save: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    import shardwise

    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config(0))
    if start:
        engine.load_checkpoint(root)
    losses = train_steps(engine, start, steps)
    if save:
        engine.save_checkpoint(root)
    return losses, full_state_dict(engine)


def test_resume_is_exact(tmp_path) -> None:  # noqa: ANN001
    whole_losses, whole_params = run_distributed(_run, WORLD, str(tmp_path / "a"), 0, STEPS, False)[0]
    first, _ = run_distributed(_run, WORLD, str(tmp_path / "b"), 0, 2, True)[0]
    rest, params = run_distributed(_run, WORLD, str(tmp_path / "b"), 2, STEPS - 2, False)[0]
    assert first + rest == whole_losses
    for name, value in whole_params.items():
        assert torch.equal(params[name], value), name
