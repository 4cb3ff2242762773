"""An allocation that fails inside the engine's forward, backward or step is explained before it propagates:
the rank logs what was live, the plan of its config and the changes that would fit (planner/oom.py). The
error itself is re-raised unchanged, so code that catches out-of-memory errors by type or message (accelerate's
`find_executable_batch_size`, a Trainer's retry) behaves as without shardwise.

[Note: live bytes at an out-of-memory] On CUDA the caching allocator counts what is allocated. On CPU it
keeps no count (and the process's mapped or resident bytes include the interpreter, libraries and memory
the C allocator keeps after a free), so the live bytes are what the engine knows of: the model states and
buffers the strategy holds, and the activations of the failing forward when it was the first (tracked)
one, else those of a whole forward.

[Note: other engines on one device] Several engines can share a GPU in one process (DeepSpeed-Chat's actor,
critic, reference and reward models). A config change to the failing engine frees none of the others' memory,
so on CUDA the model states and buffers the other live engines hold on that device are left out of what
counts as live (their exact bytes, from their own breakdowns). Tensors the script allocated outside any
engine stay counted: nothing here can tell them from this engine's temporaries.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING

import torch

from .. import accelerator
from ..planner.oom import Explanation, MemoryAtFailure, explain
from ..planner.shape import ActivationProfile, ModelShape
from ..profiling.units import binary_bytes

if TYPE_CHECKING:
    from ..protocols.engine import TrainingEngine as Engine

logger = logging.getLogger("shardwise")

_HOST_ALLOCATION_FAILED = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _HOST_ALLOCATION_FAILED)


_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
"""Every live engine of this process (see [Note: other engines on one device])."""


def held_by_other_engines(engine: Engine) -> int:
    """Device bytes of model states and buffers held by the process's other engines on `engine`'s device."""
    total = 0
    for other in list(_ENGINES):
        if other is not engine and other.device == engine.device:
            held = other.memory_breakdown()
            if engine.device.type == "cpu":  # a CPU engine's device is the host
                total += held.model_states_on_host + held.buffers.host
            else:
                total += held.model_states - held.model_states_on_host + held.buffers.device
    return total


class OutOfMemoryExplainer:
    def __init__(self, engine: Engine):
        self.engine = engine
        _ENGINES.add(engine)
        self.last: Explanation | None = None
        """The explanation of the last out-of-memory error (its text and the changes that fit)."""

    def note(self, phase: str, error: BaseException) -> None:
        """Called with every RuntimeError and MemoryError the engine's `phase` raises: an out-of-memory one is
        explained in the log and in a note on the error."""
        if is_out_of_memory(error):
            self._report(phase, error)

    def _report(self, phase: str, error: BaseException) -> None:
        engine = self.engine
        try:
            self.last = explain(error, self._facts(phase), engine.config, engine.topology.data.size,
                                ModelShape.of(engine.module))
            text = self.last.text
        except Exception as failure:  # the explanation must never hide the error it explains
            text = f"[rank {engine.global_rank}] out of memory in {phase}; the memory report failed too: {failure!r}"
        logger.error("%s", text)
        error.add_note(f"shardwise: rank {engine.global_rank}'s memory at the failure and config changes that fit "
                       "are in the log above.")

    def _facts(self, phase: str) -> MemoryAtFailure:
        engine, tracker, cfg, device = self.engine, self.engine.instruments.activations, self.engine.config, self.engine.device
        held = engine.memory_breakdown()
        profile, note, live_activations = None, "measured over a whole forward", tracker.peak or 0
        accounted = None
        width = 2 if (cfg.fp16.enabled or cfg.bf16.enabled) else 4
        if tracker.peak is not None:
            profile = ActivationProfile(tracker.peak, cfg.train_micro_batch_size_per_gpu, compute_bytes=width)
        elif tracker.partial is not None and tracker.partial_share:
            # the first forward failed part-way: what it saved, stretched to the modules it had not reached
            profile = ActivationProfile(int(tracker.partial / tracker.partial_share), cfg.train_micro_batch_size_per_gpu,
                                        compute_bytes=width)
            note = (f"estimated: the failing first forward had saved {binary_bytes(tracker.partial)} in "
                    f"{tracker.partial_share:.0%} of the modules holding parameters")
            live_activations = tracker.partial
        if tracker.peak is None and tracker.partial is not None:
            # what the plan's account held when the first forward failed (see planner/oom.py's
            # [Note: one account for the failure and the proposals]); device parts only off CPU
            states = held.model_states + held.buffers.total if device.type == "cpu" else \
                held.model_states - held.model_states_on_host + held.buffers.device
            accounted = states + tracker.partial
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        headroom = accelerator.memory_headroom(device)
        host_capacity, others = None, 0
        if device.type == "cuda":
            others = held_by_other_engines(engine)
            live = torch.cuda.memory_allocated(device) - others
            host_capacity = accelerator.memory_headroom(torch.device("cpu")).bytes // local_ranks + held.model_states_on_host
        else:  # see [Note: live bytes at an out-of-memory]
            live = held.model_states + held.buffers.total + live_activations
        where = f"{phase} of micro-step {engine.micro_steps + 1} (step {engine.global_steps + 1})"
        return MemoryAtFailure(where, engine.global_rank, str(device), held, live,
                               headroom.bytes // (local_ranks if headroom.shared else 1), headroom.bound_by, profile,
                               note, device.type == "cpu", host_capacity, others, headroom.outside_allocator, accounted)
