"""Seeing a run at world size 2: every switch on in one spawned group (CSV and TensorBoard values against
the engine's numbers, only rank 0 writing, the flops profiler at its step only, the comms logger on a
known sequence of collectives, the memory breakdown), then the timers against measured step time."""

from __future__ import annotations

import csv
import logging
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.distributed import Collectives, CommStats
from shardwise.profiling import comm_rows
from tests.harness import run_distributed
from tests.parity import ds_config, make_model, micro_batch, param_groups

STEPS, PRINT_EVERY, MICRO, ACCUM, WORLD = 6, 2, 2, 2, 2
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10,
                                            "warmup_type": "linear"}}


def _engine(config):
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(engine, steps, batches=None):
    """Per optimizer step: this rank's mean loss, lr, grad norm and the wall time of its micro-steps."""
    rank = dist.get_rank()
    batches = batches or [[micro_batch(s, m, rank, MICRO, ACCUM, WORLD) for m in range(ACCUM)] for s in range(steps)]
    record = []
    for step in range(steps):
        loss_sum, seconds = 0.0, 0.0
        for tokens, labels in batches[step]:
            start = time.perf_counter()
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
            seconds += time.perf_counter() - start
            loss_sum += loss.item()
        record.append((loss_sum / ACCUM, engine.get_lr()[0], engine.get_global_grad_norm(), seconds))
    return record


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _everything_on(tmp: str):
    import shardwise.profiling.flops_profiler as flops_profiler

    rank = int(os.environ["RANK"])  # the output path is per rank, so the config is built before init
    sessions = []
    real_session = flops_profiler.FlopsSession
    flops_profiler.FlopsSession = lambda *a: sessions.append(1) or real_session(*a)
    out = f"{tmp}/rank{rank}"
    config = ds_config(MICRO, ACCUM, steps_per_print=PRINT_EVERY, wall_clock_breakdown=True, scheduler=SCHEDULER,
                       csv_monitor={"enabled": True, "output_path": out, "job_name": "job"},
                       tensorboard={"enabled": True, "output_path": out, "job_name": "job"},
                       flops_profiler={"enabled": True, "profile_step": 1, "output_file": f"{out}/flops.txt"},
                       comms_logger={"enabled": True, "verbose": True}, memory_breakdown=True)
    lines = _Lines()
    logging.getLogger("shardwise").addHandler(lines)
    logging.getLogger("shardwise").setLevel(logging.INFO)
    engine = _engine(config)
    record = _train(engine, STEPS)
    engine.instruments.close()
    profile = engine.instruments.flops_profiler.profile
    mem = engine.memory_breakdown()
    module = engine.module
    optimizer_bytes = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values())
    memory = dict(mem=mem, params=sum(p.numel() * p.element_size() for p in module.parameters()),
                  trainable=sum(p.numel() for p in module.parameters() if p.requires_grad), optimizer=optimizer_bytes)
    summary = engine.comms_summary(print_table=False)
    all_reduces = engine.comm.stats.calls("all_reduce")
    verbose = sum("comm op all_reduce" in line for line in lines.lines)
    return dict(record=record, sessions=len(sessions), profile_flops=profile.flops, memory=memory, summary=summary,
                all_reduces=all_reduces, verbose_lines=verbose, known=_known_collectives(engine),
                zero2=_zero2_memory())


def _zero2_memory():
    """Stage 2 in bf16: partitioned gradients and optimizer state, fp32 master shards."""
    engine = _engine(ds_config(MICRO, ACCUM, bf16={"enabled": True}, zero_optimization={"stage": 2}))
    _train(engine, 2)
    return engine.memory_breakdown()


def _known_collectives(engine):
    comm = Collectives(stats=CommStats())
    group = engine.topology.data
    for _ in range(2):
        comm.all_reduce(torch.ones(100), group).wait()
    comm.all_gather(torch.empty(20), torch.ones(10), group).wait()
    comm.reduce_scatter(torch.empty(8), torch.ones(16), group).wait()
    for _ in range(3):
        comm.broadcast(torch.ones(5), 0, group).wait()
    return comm_rows(comm.stats)


def _csv(path: Path) -> dict[int, float]:
    with path.open() as f:
        rows = list(csv.reader(f))[1:]
    return {int(step): float(value) for step, value in rows}


def test_monitors_profiler_comms_and_memory(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rank0, rank1 = run_distributed(_everything_on, WORLD, str(tmp_path))
    job = tmp_path / "rank0" / "job"
    assert not (tmp_path / "rank1").exists()  # only global rank 0 writes

    # CSV values are the engine's numbers: rank 0's loss averaged over the interval, lr and grad norm at its end.
    batch = MICRO * ACCUM * WORLD
    record = rank0["record"]
    reports = {PRINT_EVERY * (i + 1) * batch: record[PRINT_EVERY * i : PRINT_EVERY * (i + 1)]
               for i in range(STEPS // PRINT_EVERY)}
    loss, lr, norm = (_csv(job / f"Train_Samples_{n}.csv") for n in ("train_loss", "lr", "grad_norm"))
    assert list(loss) == list(reports)
    for samples, steps in reports.items():
        assert loss[samples] == pytest.approx(sum(s[0] for s in steps) / PRINT_EVERY, rel=1e-6)
        assert lr[samples] == pytest.approx(steps[-1][1], rel=1e-9) and norm[samples] == pytest.approx(steps[-1][2], rel=1e-9)
    assert len(set(lr.values())) == len(lr)  # the warm-up moves the lr
    samples_s, tokens_s = _csv(job / "Train_Samples_samples_per_sec.csv"), _csv(job / "Train_Samples_tokens_per_sec.csv")
    tflops = _csv(job / "Train_Samples_tflops_per_rank.csv")
    for samples in list(reports)[1:]:  # after the profiled step: measured FLOPs per micro-batch
        assert tokens_s[samples] / samples_s[samples] == pytest.approx(5)  # tokens per sample (SEQ)
        # this rank's FLOPs per interval / all ranks' samples per interval = profile FLOPs · 2·2 micro / 16 samples
        assert tflops[samples] * 1e12 / samples_s[samples] == pytest.approx(rank0["profile_flops"] / 4, rel=1e-6)
    for phase in ("forward", "backward", "backward_reduce", "step"):
        assert len(_csv(job / f"Train_Samples_elapsed_time_ms_{phase}.csv")) == STEPS // PRINT_EVERY
    assert len(_csv(job / "Train_Samples_memory_optimizer_state_mb.csv")) == STEPS // PRINT_EVERY

    # TensorBoard's event file holds the same values.
    acc = EventAccumulator(str(job))
    acc.Reload()
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars("Train/Samples/train_loss")] == list(loss.items())

    # Flops profiler: one profiled micro-batch per rank, at profile_step; rank 0 wrote the report.
    assert rank0["sessions"] == rank1["sessions"] == 1
    assert "Profile of optimizer step 1's first micro-batch" in (job.parent / "flops.txt").read_text()
    assert rank0["profile_flops"] == rank1["profile_flops"] > 0

    # Comms logger: the known sequence, per message size; every engine all-reduce logged (verbose).
    for result in (rank0, rank1):
        rows = {(r.op, r.message_bytes): r for r in result["known"]}
        assert {k: r.count for k, r in rows.items()} == {("all_reduce", 400): 2, ("all_gather", 80): 1,
                                                          ("reduce_scatter", 64): 1, ("broadcast", 20): 3}
        for r in rows.values():
            assert r.group_size == 2 and r.waited == r.count and r.total_latency_s > 0
        assert rows[("all_reduce", 400)].busbw_bytes_per_s == pytest.approx(rows[("all_reduce", 400)].algbw_bytes_per_s)
        assert rows[("all_gather", 80)].busbw_bytes_per_s == pytest.approx(rows[("all_gather", 80)].algbw_bytes_per_s / 2)
        assert result["verbose_lines"] == result["all_reduces"] > 0
        assert "all_reduce" in result["summary"] and "busbw" in result["summary"]

    # Memory breakdown: byte counts of the engine's tensors.
    for result in (rank0, rank1):
        m = result["memory"]
        mem = m["mem"]
        assert mem.parameters.host == m["params"] and mem.optimizer_state.host == m["optimizer"]
        assert m["trainable"] * 4 <= mem.gradients.host <= m["trainable"] * 4 + 4096  # bucket padding
        assert mem.master_weights.total == 0 and mem.buffers.total == 0
        assert mem.activations_peak > 0 and mem.host_peak_rss > 0
        assert mem.expected_model_states == pytest.approx(mem.model_states, rel=0.01)  # padding, Adam's step counters
        zero2 = result["zero2"]
        assert zero2.master_weights.total > 0 and zero2.parameters.total < m["params"]  # bf16 parameters
        assert zero2.expected_model_states == pytest.approx(zero2.model_states, rel=0.01)


def _timed(micro, stage=0):
    # Large micro-batches (steps of tens of ms): the engine's few untimed lines and scheduler jitter on a
    # busy machine stay a small share of a step.
    config = ds_config(micro, ACCUM, steps_per_print=4, wall_clock_breakdown=True, zero_optimization={"stage": stage})
    engine = _engine(config)
    reported = []
    on_step = engine.instruments.reporter.on_step
    engine.instruments.reporter.on_step = lambda f, flops, timers_ms: reported.append(timers_ms) or on_step(f, flops, timers_ms)
    rank = dist.get_rank()
    batches = [[micro_batch(s, m, rank, micro, ACCUM, WORLD) for m in range(ACCUM)] for s in range(8)]
    record = _train(engine, 8, batches)
    return reported[-1], sum(r[3] for r in record[4:]) / 4


def test_phase_timers_add_up_to_the_step_time():
    for timers_ms, step_s in run_distributed(_timed, WORLD, 256):
        phases = timers_ms["forward"] + timers_ms["backward"] + timers_ms["step"]  # backward_reduce is inside backward
        assert timers_ms["backward_reduce"] <= timers_ms["backward"]
        # 10% as the issue asks, plus 3 ms: on a busy 2-core machine the OS can preempt a rank between
        # two timed phases, which the step's wall time sees and no phase timer does.
        assert abs(phases / 1e3 - step_s) <= 0.10 * step_s + 3e-3, (timers_ms, step_s)


def test_zero2_reports_the_allgather_inside_the_step():
    for timers_ms, _ in run_distributed(_timed, WORLD, 8, 2):
        assert 0 < timers_ms["step_allgather"] <= timers_ms["step"]
