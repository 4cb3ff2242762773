"""Pipeline parallelism. So far its pure base: the schedules (which stage forwards, backwards, sends and
receives what, in which order) and a simulator that runs them on paper. PipelineModule, the p2p layer and
the executor (train_batch / eval_batch) come on top and follow these lists; none of this imports torch."""

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
