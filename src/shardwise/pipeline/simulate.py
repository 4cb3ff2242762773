"""Runs a `Schedule`'s stages against each other on paper: timeline, bubble, activation memory, deadlock.

The model is the executor's contract (instructions.py): compute steps take fixed times, sends never
block and deliver after `comm_time`, a receive waits for its message. Each stage runs its list in
order; because a stage's clock depends only on its own list and the arrival times of what it receives,
stepping stages round-robin until none can move gives the one true timeline. When none can move and
some are not done, the schedule would deadlock an executor: the error names each waiting stage, the
instruction it waits at, and whether the message is never sent at all or is sent only after a wait that
closes a cycle.

Times are for a stage's whole share of the model; with `chunks` model chunks per stage, one chunk's
forward takes `forward_time / chunks` (so interleaved schedules compare fairly with plain ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .instructions import RECEIVES, SENDS, Instruction, Op, Schedule


class ScheduleError(ValueError):
    """A schedule an executor cannot run: a deadlock, an unmatched message, a backward before its forward."""


@dataclass(frozen=True)
class SimulationResult:
    """What one batch costs under a schedule. `idle_per_stage[s]` is the time stage `s` computes nothing
    before the makespan (its share of the bubble); `peak_in_flight[s]` the most (micro-batch, chunk)
    pairs whose activations stage `s` held at once (forwarded, last backward part not yet run), and
    `peak_activations[s]` the same in units of one micro-batch's activations for a whole stage."""

    makespan: float
    busy_per_stage: tuple[float, ...]
    idle_per_stage: tuple[float, ...]
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    peak_activations: tuple[float, ...]


@dataclass
class _Stage:
    """One stage's progress through its list."""

    index: int
    instructions: tuple[Instruction, ...]
    at: int = 0
    clock: float = 0.0
    busy: float = 0.0
    held: set[tuple[int, int]] = field(default_factory=set)
    backwarded: set[tuple[int, int]] = field(default_factory=set)
    peak: int = 0

    @property
    def done(self) -> bool:
        return self.at == len(self.instructions)

    @property
    def current(self) -> Instruction:
        return self.instructions[self.at]

    def where(self) -> str:
        return f"stage {self.index}, instruction #{self.at} {self.current}"


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0, *,
             backward_input_time: float | None = None, comm_time: float = 0.0) -> SimulationResult:
    """The timeline of `schedule`. A split backward's input part takes `backward_input_time` (half of
    `backward_time` unless given) and its weight part the rest. Raises ScheduleError when an executor
    following the schedule would hang or misuse activations."""
    input_time = backward_time / 2 if backward_input_time is None else backward_input_time
    per_chunk = 1.0 / schedule.chunks
    durations = {Op.FORWARD: forward_time * per_chunk, Op.BACKWARD: backward_time * per_chunk,
                 Op.BACKWARD_INPUT: input_time * per_chunk, Op.BACKWARD_WEIGHT: (backward_time - input_time) * per_chunk}
    stages = [_Stage(s, tuple(lst)) for s, lst in enumerate(schedule.per_stage)]
    mailbox: dict[tuple, float] = {}  # message key -> arrival time
    while not all(s.done for s in stages):
        moved = False
        for stage in stages:
            while not stage.done and _step(stage, schedule, mailbox, durations, comm_time):
                moved = True
        if not moved:
            raise ScheduleError(_deadlock_message(schedule, stages))
    if mailbox:
        key = next(iter(mailbox))
        raise ScheduleError(f"schedule {schedule.name!r}: {_describe(key)} is sent but no stage receives it. "
                            "Add the matching receive or drop the send.")
    return _result(stages, schedule.chunks)


def _step(stage: _Stage, schedule: Schedule, mailbox: dict[tuple, float], durations: dict[Op, float],
          comm_time: float) -> bool:
    """Run the stage's current instruction if it can run now; False when it waits for a message."""
    ins = stage.current
    if ins.op in RECEIVES:
        key = message_key(schedule, stage.index, ins)
        if key not in mailbox:
            return False
        stage.clock = max(stage.clock, mailbox.pop(key))
    elif ins.op in SENDS:
        key = message_key(schedule, stage.index, ins)
        if key in mailbox:
            raise ScheduleError(f"{stage.where()}: this message is already sent and not yet received. "
                                "Send each (micro-batch, chunk) once per direction.")
        mailbox[key] = stage.clock + comm_time
    elif ins.op in durations:
        _track_activations(stage, ins)
        stage.clock += durations[ins.op]
        stage.busy += durations[ins.op]
    stage.at += 1
    return True


def _track_activations(stage: _Stage, ins: Instruction) -> None:
    """Forward takes a (micro-batch, chunk) in; the last part of its backward lets it go. Anything out of
    that order means an executor would run backward on activations it does not have."""
    item = (ins.micro_batch, ins.chunk)
    if ins.op is Op.FORWARD:
        if item in stage.held or item in stage.backwarded:
            raise ScheduleError(f"{stage.where()}: forward of a micro-batch and chunk forwarded before. "
                                "Forward each (micro-batch, chunk) once per batch.")
        stage.held.add(item)
        stage.peak = max(stage.peak, len(stage.held))
        return
    if item not in stage.held:
        raise ScheduleError(f"{stage.where()}: backward of a micro-batch and chunk this stage has not forwarded "
                            "(or has already released). Put its forward first.")
    split_done = item in stage.backwarded
    if ins.op is Op.BACKWARD_WEIGHT and not split_done:
        raise ScheduleError(f"{stage.where()}: the weight part runs before the input part. "
                            "Put backward_input of the same micro-batch and chunk first.")
    if ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and split_done:
        raise ScheduleError(f"{stage.where()}: this micro-batch and chunk is already backwarded.")
    stage.backwarded.add(item)
    if ins.op is not Op.BACKWARD_INPUT:
        stage.held.discard(item)


def message_key(schedule: Schedule, stage: int, ins: Instruction) -> tuple:
    """(what, micro-batch, from virtual stage, to virtual stage): equal on a send and its receive. Also
    checks the instruction's peer is the stage that really holds the other end."""
    here = ins.chunk * schedule.stages + stage
    step = 1 if ins.op in (Op.SEND_ACTIVATION, Op.RECV_GRAD) else -1
    there = here + step
    if not 0 <= there < schedule.virtual_stages or not 0 <= ins.chunk < schedule.chunks:
        raise ScheduleError(f"stage {stage}: {ins} has no other end (virtual stage {there} of "
                            f"{schedule.virtual_stages}). Only neighbouring virtual stages exchange tensors.")
    if ins.peer != there % schedule.stages:
        raise ScheduleError(f"stage {stage}: {ins} names peer {ins.peer}; the other end is stage "
                            f"{there % schedule.stages}. Use the neighbouring stage as peer.")
    what = "activation" if ins.op in (Op.SEND_ACTIVATION, Op.RECV_ACTIVATION) else "grad"
    source, target = (here, there) if ins.op in SENDS else (there, here)
    return (what, ins.micro_batch, source, target)


def _describe(key: tuple) -> str:
    what, mb, source, target = key
    return f"the {what} of micro-batch {mb} from virtual stage {source} to virtual stage {target}"


def _deadlock_message(schedule: Schedule, stages: list[_Stage]) -> str:
    """Why nobody can move: for each waiting stage, whether its message is never sent or is stuck behind
    another stage's wait (a cycle)."""
    sent_later = {message_key(schedule, s.index, ins) for s in stages for ins in s.instructions[s.at:]
                  if ins.op in SENDS}
    lines = []
    for stage in (s for s in stages if not s.done):
        key = message_key(schedule, stage.index, stage.current)
        reason = ("it is sent only after instructions that wait themselves (a cycle)" if key in sent_later
                  else "no stage ever sends it")
        lines.append(f"{stage.where()} waits for {_describe(key)}: {reason}")
    return (f"schedule {schedule.name!r} deadlocks: " + "; ".join(lines)
            + ". Reorder so every receive's matching send can run first.")


def _result(stages: list[_Stage], chunks: int) -> SimulationResult:
    makespan = max(s.clock for s in stages)
    idle = tuple(makespan - s.busy for s in stages)
    fraction = sum(idle) / (len(stages) * makespan) if makespan else 0.0
    return SimulationResult(makespan, tuple(s.busy for s in stages), idle, fraction,
                            tuple(s.peak for s in stages), tuple(s.peak / chunks for s in stages))


def theoretical_bubble_fraction(schedule: str, stages: int, micro_batches: int, chunks: int = 1,
                                forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """The closed form the simulator should reproduce with no communication time, for the schedules
    built here (by name). GPipe and 1F1B: (p - 1) / (m + p - 1) whatever the times; interleaved:
    (p - 1) / (v·m + p - 1). ZB-H1 (backward split in halves B = W, valid while W <= F): the makespan
    is the larger of m(F+B+W) + (p-1)(F+B-W) (steady state) and (m+p-1)(F+B) + W (too few micro-batches
    to fill the drain)."""
    p, m = stages, micro_batches
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (chunks * m + p - 1)
    if schedule == "zb_h1":
        f, half = forward_time, backward_time / 2
        makespan = max(m * (f + 2 * half) + (p - 1) * f, (m + p - 1) * (f + half) + half)
        return 1 - m * (f + 2 * half) / makespan
    raise ValueError(f"schedule: one of gpipe, 1f1b, interleaved_1f1b, zb_h1 is required; got {schedule!r}. "
                     "Simulate other schedules instead.")
