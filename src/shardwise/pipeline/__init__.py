"""Pipeline parallelism. The pure base — the schedules (which stage forwards, backwards, sends and receives
what, in which order: GPipe, 1F1B, interleaved, ZB-H1) and a simulator that runs them on paper — imports no
torch and is what this package exports; PipelineModule (`module.py`), the p2p layer (`p2p.py`), the executor
that follows a schedule's lists (`executor.py`) and tied weights (`tied.py`) build on it, and
`runtime/pipe_engine.py` puts them behind train_batch / eval_batch."""

from .instructions import Instruction, Op, Schedule
from .interleaved import interleaved_1f1b
from .schedule import gpipe, inference, one_f_one_b
from .simulate import (
    ScheduleError,
    SimulationResult,
    simulate,
    theoretical_bubble_fraction,
)
from .zero_bubble import zb_h1

__all__ = ["Instruction", "Op", "Schedule", "ScheduleError", "SimulationResult", "gpipe", "inference",
           "interleaved_1f1b", "one_f_one_b", "simulate", "theoretical_bubble_fraction", "zb_h1"]
