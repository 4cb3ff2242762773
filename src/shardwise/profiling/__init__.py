"""Where a run's time, FLOPs, traffic and memory go: phase timers, the flops profiler (also standalone:
`get_model_profile`, as DeepSpeed's `deepspeed.profiling.flops_profiler.get_model_profile`), the comms
logger over the collectives' counters, and the memory breakdown."""

from .comms import CommRow, CommsLogger, bus_factor, comm_rows, summary_table
from .flops import ModelProfile, ModuleProfile
from .flops_profiler import FlopsProfiler, get_model_profile, profile_model
from .memory import Bytes, MemoryBreakdown, memory_breakdown
from .timers import StepTimers

__all__ = [
    "Bytes",
    "CommRow",
    "CommsLogger",
    "FlopsProfiler",
    "MemoryBreakdown",
    "ModelProfile",
    "ModuleProfile",
    "StepTimers",
    "bus_factor",
    "comm_rows",
    "get_model_profile",
    "memory_breakdown",
    "profile_model",
    "summary_table",
]
