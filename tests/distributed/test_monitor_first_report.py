"""The report line's samples/s is a rate over time the steps really took, from the first line on.

Each step sleeps PAUSE seconds where the engine's clock must be running (between forward and backward; in a
pipeline's data iterator, which train_batch reads), so a reported rate above samples / PAUSE was divided by
an interval that missed the step, and one below samples / (the step's wall time) by one that is too long.
A script that calls `engine.module(...)` itself never passes through the engine's forward: its first line
has no rate (its steps' start is unknown), and the next line's rate covers the interval between the two.
"""

from __future__ import annotations

import logging
import re
import time

import pytest

from tests.harness import run_distributed
from tests.logs import LogMessages

PAUSE, STEPS, MICRO, ACCUM = 0.05, 2, 2, 2
SAMPLES = MICRO * ACCUM  # one rank
RATE = re.compile(r"\| ([0-9.]+) samples/s")


def _report_lines(kind: str) -> tuple[list[str], list[float]]:
    """Rank 0's step lines and each step's wall time (from before its first forward to after its step)."""
    import shardwise
    import torch.distributed as dist

    messages = LogMessages()
    logger = logging.getLogger("shardwise")
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    walls = []
    if kind == "pipeline":
        from shardwise.pipe import PipelineModule
        from tests.pipeline_models import layer_specs, loss_fn, micro_batches, pipe_config

        def paused(step):
            for batch in micro_batches(step, MICRO, ACCUM, 0, 1):
                time.sleep(PAUSE)
                yield batch

        module = PipelineModule(layer_specs(2), num_stages=1, loss_fn=loss_fn)
        engine, *_ = shardwise.initialize(model=module, model_parameters=module.parameters(),
                                          config=pipe_config(MICRO, ACCUM, 0.01, steps_per_print=1))
        for step in range(STEPS):
            start = time.perf_counter()
            engine.train_batch(paused(step))
            walls.append(time.perf_counter() - start)
    else:
        from tests.parity import ds_config, make_model, micro_batch, param_groups

        model = make_model()
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                          config=ds_config(MICRO, ACCUM, steps_per_print=1))
        call = engine if kind == "engine" else engine.module  # "module": DeepSpeed's GAN tutorial calls the module
        for step in range(STEPS):
            start = time.perf_counter()
            for m in range(ACCUM):
                loss = call(*micro_batch(step, m, dist.get_rank(), MICRO, ACCUM, 1))
                time.sleep(PAUSE)
                engine.backward(loss)
                engine.step()
            walls.append(time.perf_counter() - start)
    return [m for m in messages.messages if m.startswith("step ") and "| loss " in m], walls


def _rate(line: str) -> float | None:
    found = RATE.search(line)
    return float(found.group(1)) if found else None


@pytest.mark.parametrize("kind", ["engine", "pipeline"])
def test_first_report_rate_is_over_the_timed_step(kind):
    lines, walls = run_distributed(_report_lines, 1, kind)[0]
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 2"], lines
    for line, wall in zip(lines, walls):
        rate = _rate(line)
        assert rate is not None, line
        # The clock ran through every pause of the step, and not much longer than the step (the second interval
        # starts at the first report, a moment before the second step's clock here).
        assert SAMPLES / wall * 0.9 <= rate <= SAMPLES / (ACCUM * PAUSE), (line, wall)


def test_no_rate_until_a_step_was_timed():
    lines, walls = run_distributed(_report_lines, 1, "module")[0]
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 2"], lines
    assert _rate(lines[0]) is None and "loss " in lines[0], lines[0]
    rate = _rate(lines[1])
    assert rate is not None and rate <= SAMPLES / (ACCUM * PAUSE), lines[1]  # report to report: step 2 whole
