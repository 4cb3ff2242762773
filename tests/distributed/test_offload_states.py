"""`engine.offload_states()` / `engine.reload_states()` (DeepSpeed's API, DeepSpeedExamples' training/offload_states),
at world size 2.

This machine has no accelerator, so the offload tests count host storages as offloadable (`StateParking.movable`):
the same code then frees and restores them as it would accelerator memory. Without that, offloading a CPU run's
states is a no-op (they are in host memory already), which one test checks as such."""

from __future__ import annotations

import pytest
import torch

import shardwise
from tests.harness import run_distributed
from tests.parity import ds_config, make_model, micro_batch, param_groups, train_steps

MICRO = 2


def _engine(stage, bf16=False, optimizer=None, **extra):
    model = make_model()
    if stage == 3:  # TinyNet's root forward reads the embedding as its output projection
        shardwise.zero.register_external_parameter(model, model.embed.weight)
    config = ds_config(MICRO, 1, zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 100},
                       bf16={"enabled": bf16}, **extra)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config,
                                      optimizer=optimizer)
    return engine


def _count_host_memory():
    from shardwise.runtime.state_offload import StateParking

    StateParking.movable = staticmethod(lambda storage: storage.device.type != "meta")


def _state_tensors(engine):
    from shardwise.runtime.state_offload import state_tensors

    return state_tensors(engine.strategy, engine.optimizer)


def _nbytes(engine):
    """Bytes each kind of state holds now (a freed storage holds none)."""
    out = {}
    for kind, tensors in _state_tensors(engine).items():
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
        out[kind] = sum(s.nbytes() for s in storages.values())
    return out


def _probe(engine):
    import torch.distributed as dist

    tokens, labels = micro_batch(99, 0, dist.get_rank(), MICRO, 1, dist.get_world_size())
    with torch.no_grad():
        return engine(tokens, labels).item()


def _refused(call):
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return None


def _roundtrip(stage, bf16, include):
    """Train 2 steps, offload, check what was freed and what is refused, reload, train 2 more; the same 4 steps
    without offloading for comparison."""
    _count_host_memory()
    plain = _engine(stage, bf16)
    expected = train_steps(plain, 0, 4)
    engine = _engine(stage, bf16)
    losses = train_steps(engine, 0, 2)
    before = _nbytes(engine)
    probe_before = _probe(engine)
    engine.offload_states(include=include)
    after = _nbytes(engine)
    probe_offloaded = None if "lp_params" in engine._parking.offloaded else _probe(engine)
    refusals = {"forward": _refused(lambda: _probe(engine)), "step": _refused(engine.step),
                "save": _refused(lambda: engine.save_checkpoint("/nonexistent"))}
    engine.reload_states()
    restored = _nbytes(engine)
    probe_reloaded = _probe(engine)
    losses += train_steps(engine, 2, 2)
    return dict(expected=expected, losses=losses, before=before, after=after, restored=restored,
                probes=(probe_before, probe_offloaded, probe_reloaded), refusals=refusals)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_all_frees_every_state_and_reload_resumes_exactly(stage):
    for r in run_distributed(_roundtrip, 2, stage, False, None, timeout=180):
        assert r["losses"] == r["expected"]  # bit for bit: the same bytes came back
        assert all(r["before"][k] > 0 for k in ("optim_states", "hp_params", "lp_params", "lp_grads"))
        assert all(v == 0 for v in r["after"].values()), r["after"]
        assert r["restored"] == r["before"]
        assert r["probes"][0] == r["probes"][2]
        assert "lp_params" in r["refusals"]["forward"] and "engine.reload_states() first" in r["refusals"]["forward"]
        assert r["refusals"]["step"].startswith("engine.step(): the engine's optim_states, hp_params, lp_params")
        assert r["refusals"]["save"].startswith("engine.save_checkpoint(): the engine's")


def test_offload_optimizer_side_keeps_the_weights_usable():
    """OpenRLHF's subset at stage 3 in bf16: the optimizer state and the fp32 masters go, the 16-bit weights stay,
    so a forward (a rollout's log-probs) still runs; the step waits for reload."""
    include = ["optim_states", "hp_params", "contiguous_grad_buffer"]
    for r in run_distributed(_roundtrip, 2, 3, True, include, timeout=180):
        assert r["losses"] == r["expected"]
        assert r["after"]["optim_states"] == 0 and r["after"]["hp_params"] == 0
        assert r["after"]["lp_params"] == r["before"]["lp_params"] > 0
        assert r["after"]["lp_grads"] == r["before"]["lp_grads"] > 0
        assert r["probes"][0] == r["probes"][1] == r["probes"][2]
        assert r["refusals"]["forward"] is None
        assert r["refusals"]["step"].startswith("engine.step(): the engine's optim_states, hp_params were offloaded")


def _fp32_masters_only():
    _count_host_memory()
    engine = _engine(3)
    train_steps(engine, 0, 1)
    before = _nbytes(engine)
    engine.offload_states(include=["hp_params"])
    after = _nbytes(engine)
    probe = _probe(engine)
    engine.reload_states()
    return before, after, probe, _probe(engine)


def test_fp32_masters_shared_with_the_weights_stay():
    """In fp32 the masters are the stored weights themselves: offloading hp_params alone leaves them (the weights
    are in use), which is DeepSpeed's footprint after offloading its separate fp32 copy."""
    for before, after, probe, probe_after in run_distributed(_fp32_masters_only, 2):
        assert after == before and probe == probe_after


def _on_cpu():
    engine = _engine(3, True)
    train_steps(engine, 0, 1)
    storages = {k: [t.untyped_storage().data_ptr() for t in ts]
                for k, ts in _state_tensors(engine).items()}
    before = _nbytes(engine)
    engine.offload_states()
    same = storages == {k: [t.untyped_storage().data_ptr() for t in ts]
                        for k, ts in _state_tensors(engine).items()}
    losses = train_steps(engine, 1, 1)  # nothing is refused: nothing left accelerator memory
    engine.reload_states()
    return before == _nbytes(engine), same, losses


def test_host_states_stay_put():
    """Without an accelerator every state is in host memory already: offloading to the CPU leaves it as it is."""
    for unchanged, same, losses in run_distributed(_on_cpu, 2):
        assert unchanged and same and len(losses) == 1


def _arguments():
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    engine = _engine(2)
    out = {}
    for name, call in [("nvme", lambda: engine.offload_states(device=OffloadDeviceEnum.nvme)),
                       ("gpu", lambda: engine.offload_states(device="cuda")),
                       ("kind", lambda: engine.offload_states(include=["optimizer"])),
                       ("none", lambda: engine.offload_states(device=OffloadDeviceEnum.none)),
                       ("enum", lambda: engine.offload_states(include=[OffloadStateTypeEnum.optim_states],
                                                              device=OffloadDeviceEnum.cpu))]:
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    out["offloaded"] = dict(engine._parking.offloaded)
    engine.reload_states()
    return out


def test_offload_arguments():
    out = run_distributed(_arguments, 2)[0]
    assert out["nvme"].startswith("engine.offload_states(): device 'nvme' is not supported; states can be offloaded "
                                  "to host memory only")
    assert "device 'cuda' is not supported" in out["gpu"]
    assert "include: 'optimizer' is not a state kind" in out["kind"] and "optim_states" in out["kind"]
    assert out["none"] is None and out["enum"] is None
    assert out["offloaded"] == {"optim_states": []}  # a CPU run: marked, nothing moved


def _rollback():
    import numpy as np

    _count_host_memory()
    engine = _engine(2, True)
    expected = train_steps(_engine(2, True), 0, 3)
    losses = train_steps(engine, 0, 2)
    state = next(iter(engine.optimizer.state.values()))
    state["exp_avg_sq"] = torch.from_numpy(state["exp_avg_sq"].numpy().copy())  # a storage that cannot be resized
    before = _nbytes(engine)
    try:
        engine.offload_states()
        error = None
    except RuntimeError as e:
        error = str(e)
    after = _nbytes(engine)
    losses += train_steps(engine, 2, 1)
    return error, before, after, losses, expected


def test_a_failed_offload_puts_everything_back():
    for error, before, after, losses, expected in run_distributed(_rollback, 2):
        assert error is not None and "resiz" in error
        assert after == before and losses == expected
