"""Pipeline schedules (pure): every schedule runs in the simulator without deadlock for p = 1..5 and
m = 1..17, each (micro-batch, chunk) is forwarded and backwarded once in order, sends pair one to one
with receives, and bubble and activation peak equal their closed forms, derived here by hand."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from shardwise.pipeline import (
    Instruction,
    Op,
    Schedule,
    ScheduleError,
    gpipe,
    inference,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    theoretical_bubble_fraction,
    zb_h1,
)

STAGES = range(1, 6)
MICRO_BATCHES = range(1, 18)


def _every_schedule() -> Iterator[Schedule]:
    for p in STAGES:
        for m in MICRO_BATCHES:
            yield from (gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m), inference(p, m))
            if m % p == 0:
                yield from (interleaved_1f1b(p, m, 2), interleaved_1f1b(p, m, 3))


def _positions(instructions: tuple[Instruction, ...], op: Op) -> dict[tuple[int, int], list[int]]:
    found: dict[tuple[int, int], list[int]] = {}
    for i, ins in enumerate(instructions):
        if ins.op is op:
            found.setdefault((ins.micro_batch, ins.chunk), []).append(i)
    return found


def _check_compute(schedule: Schedule) -> None:
    everything = {(mb, c) for mb in range(schedule.micro_batches) for c in range(schedule.chunks)}
    for stage, instructions in enumerate(schedule.per_stage):
        where = f"{schedule.name} p={schedule.stages} m={schedule.micro_batches} stage {stage}"
        forwards = _positions(instructions, Op.FORWARD)
        assert set(forwards) == everything and all(len(v) == 1 for v in forwards.values()), where
        if schedule.name == "inference":
            assert not any(ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.OPTIMIZER_STEP) for ins in instructions)
            continue
        ends = _positions(instructions, Op.BACKWARD_WEIGHT if schedule.name == "zb_h1" else Op.BACKWARD)
        assert set(ends) == everything and all(len(v) == 1 for v in ends.values()), where
        if schedule.name == "zb_h1":
            inputs = _positions(instructions, Op.BACKWARD_INPUT)
            assert set(inputs) == everything and all(inputs[k][0] < ends[k][0] for k in everything), where
            ends = inputs
        assert all(forwards[k][0] < ends[k][0] for k in everything), f"{where}: backward before forward"
        assert [ins.op for ins in instructions[-2:]] == [Op.REDUCE_GRADS, Op.OPTIMIZER_STEP], where


def _messages(schedule: Schedule, ops: tuple[Op, Op]) -> Counter:
    """(kind, micro-batch, from virtual stage, to virtual stage) of every send (ops[0]) or receive (ops[1]),
    with each peer checked against the neighbour computed here."""
    p = schedule.stages
    found: Counter = Counter()
    for stage, instructions in enumerate(schedule.per_stage):
        for ins in instructions:
            if ins.op not in ops:
                continue
            here = ins.chunk * p + stage
            activation = ins.op in (Op.SEND_ACTIVATION, Op.RECV_ACTIVATION)
            there = here + 1 if ins.op in (Op.SEND_ACTIVATION, Op.RECV_GRAD) else here - 1
            assert ins.peer == there % p, f"{schedule.name} stage {stage}: {ins}"
            sent = ins.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD)
            found[(activation, ins.micro_batch) + ((here, there) if sent else (there, here))] += 1
    return found


def test_every_schedule_runs_without_deadlock_and_does_each_step_once_in_order():
    count = 0
    for schedule in _every_schedule():
        simulate(schedule)  # raises ScheduleError on a deadlock or misuse
        _check_compute(schedule)
        count += 1
    assert count > 400


def test_sends_pair_one_to_one_with_receives_and_ends_load_data():
    for schedule in _every_schedule():
        sends = _messages(schedule, (Op.SEND_ACTIVATION, Op.SEND_GRAD))
        receives = _messages(schedule, (Op.RECV_ACTIVATION, Op.RECV_GRAD))
        assert sends == receives and set(sends.values()) <= {1}, schedule.name
        links = schedule.virtual_stages - 1
        per_link = 2 if schedule.name != "inference" else 1
        assert len(sends) == links * schedule.micro_batches * per_link
        first, last = schedule.per_stage[0], schedule.per_stage[-1]
        loads = [ins.micro_batch for ins in first if ins.op is Op.LOAD_MICRO_BATCH]
        labels = [ins.micro_batch for ins in last if ins.op is Op.LOAD_LABELS]
        assert sorted(loads) == sorted(labels) == list(range(schedule.micro_batches)), schedule.name


@pytest.mark.parametrize("forward_time, backward_time", [(1, 2), (1, 1), (2, 3)])
def test_gpipe_and_1f1b_bubble_is_the_closed_form(forward_time, backward_time):
    # With uniform stages and free communication, the last micro-batch's backward on stage 0 ends after
    # m steady (F + B) plus p - 1 fill/drain steps: makespan (m + p - 1)(F + B), each stage busy m(F + B).
    for p in STAGES:
        for m in MICRO_BATCHES:
            for build in (gpipe, one_f_one_b):
                r = simulate(build(p, m), forward_time, backward_time)
                assert r.makespan == pytest.approx((m + p - 1) * (forward_time + backward_time))
                assert r.idle_per_stage == pytest.approx([(p - 1) * (forward_time + backward_time)] * p)
                assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_activation_peaks_gpipe_holds_all_1f1b_at_most_p_minus_s_zb_at_most_p():
    for p in STAGES:
        for m in MICRO_BATCHES:
            assert simulate(gpipe(p, m)).peak_in_flight == (m,) * p
            assert simulate(one_f_one_b(p, m)).peak_in_flight == tuple(min(p - s, m) for s in range(p))
            assert simulate(zb_h1(p, m)).peak_in_flight == (min(p, m),) * p


def test_1f1b_warmup_is_deepspeeds():
    # DeepSpeed's TrainSchedule: stage s runs min(p - s - 1, m) forwards before the steady 1F1B phase.
    for p in STAGES:
        for m in MICRO_BATCHES:
            for s, instructions in enumerate(one_f_one_b(p, m).per_stage):
                compute = [ins.op for ins in instructions if ins.op in (Op.FORWARD, Op.BACKWARD)]
                assert compute.index(Op.BACKWARD) == min(p - s - 1, m) + (1 if m > p - s - 1 else 0)


def test_interleaved_bubble_is_the_closed_form_and_beats_1f1b():
    # Each chunk is 1/v of a stage, so fill and drain shrink by v: bubble (p-1)/v of (F+B) per stage.
    for p in STAGES:
        for m in range(p, 18, p):
            plain = simulate(one_f_one_b(p, m)).bubble_fraction
            for v in (2, 3, 4):
                r = simulate(interleaved_1f1b(p, m, v))
                assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
                assert p == 1 or r.bubble_fraction < plain


@pytest.mark.parametrize("forward_time, backward_time", [(1, 2), (2, 2), (2, 1)])
def test_zb_h1_bubble_is_the_closed_form_and_beats_1f1b_and_two_chunk_interleaving(forward_time, backward_time):
    # B = W = backward/2 (<= F here). Steady state: m(F+B+W) plus (p-1)(F+B-W) of fill the W's cannot hide;
    # with m < p the drain is the chain of F and B through every stage, plus stage 0's last W.
    f, half = forward_time, backward_time / 2
    for p in STAGES:
        for m in MICRO_BATCHES:
            r = simulate(zb_h1(p, m), forward_time, backward_time)
            makespan = max(m * (f + 2 * half) + (p - 1) * f, (m + p - 1) * (f + half) + half)
            assert r.makespan == pytest.approx(makespan)
            assert r.bubble_fraction < simulate(one_f_one_b(p, m), f, backward_time).bubble_fraction or p == 1
            if p > 1 and m % p == 0 and (f, backward_time) == (1, 2):
                assert r.bubble_fraction < simulate(interleaved_1f1b(p, m, 2)).bubble_fraction


def test_the_theory_function_agrees_with_the_simulator():
    for p, m in [(2, 4), (4, 8), (4, 16), (3, 2)]:
        for name, schedule in [("gpipe", gpipe(p, m)), ("1f1b", one_f_one_b(p, m)), ("zb_h1", zb_h1(p, m))]:
            assert simulate(schedule).bubble_fraction == pytest.approx(theoretical_bubble_fraction(name, p, m))
    assert simulate(interleaved_1f1b(4, 8, 2)).bubble_fraction == pytest.approx(
        theoretical_bubble_fraction("interleaved_1f1b", 4, 8, chunks=2))


@pytest.mark.parametrize("comm_time", [0.1, 0.3])
def test_gpipe_and_interleaved_pay_communication_only_along_the_chain(comm_time):
    # A micro-batch crosses p·v - 1 links forward and as many back; both schedules keep enough forwards
    # in flight (Megatron's long interleaved warm-up is what buys this) to hide every other transfer.
    # Plain 1F1B cannot: its steady state waits for each gradient, so it pays at least as much.
    for p in STAGES:
        for m in MICRO_BATCHES:
            chain = 2 * (p - 1) * comm_time
            assert simulate(gpipe(p, m), comm_time=comm_time).makespan == pytest.approx((m + p - 1) * 3 + chain)
            assert simulate(one_f_one_b(p, m), comm_time=comm_time).makespan >= (m + p - 1) * 3 + chain - 1e-9
            for v in (2, 3) if m % p == 0 else ():
                r = simulate(interleaved_1f1b(p, m, v), comm_time=comm_time)
                assert r.makespan == pytest.approx(3 * m + 3 * (p - 1) / v + 2 * (p * v - 1) * comm_time)


def test_interleaved_holds_megatrons_warmup_plus_one_chunk_activations():
    # Warm-up of 2(p - s - 1) + (v - 1)p forwards, then one more before the first backward.
    for p in STAGES:
        for m in range(p, 18, p):
            for v in (2, 3):
                peaks = simulate(interleaved_1f1b(p, m, v)).peak_in_flight
                assert peaks == tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p))


def _ins(op: Op, mb: int | None = 0, peer: int | None = None) -> Instruction:
    return Instruction(op, mb, 0, peer)


def _two_stages(first: list[Instruction], second: list[Instruction]) -> Schedule:
    return Schedule("hand-made", 2, 1, 1, (tuple(first), tuple(second)))


SECOND_STAGE = [_ins(Op.RECV_ACTIVATION, peer=0), _ins(Op.LOAD_LABELS), _ins(Op.FORWARD), _ins(Op.BACKWARD),
                _ins(Op.SEND_GRAD, peer=0)]


def test_a_cycle_is_reported_with_the_stage_and_instruction():
    # Stage 0 waits for the gradient before sending the activation the gradient depends on.
    broken = _two_stages([_ins(Op.LOAD_MICRO_BATCH), _ins(Op.FORWARD), _ins(Op.RECV_GRAD, peer=1),
                          _ins(Op.SEND_ACTIVATION, peer=1), _ins(Op.BACKWARD)], SECOND_STAGE)
    with pytest.raises(ScheduleError) as info:
        simulate(broken)
    text = str(info.value)
    assert "deadlocks" in text and "a cycle" in text
    assert "stage 0, instruction #2 recv_grad(mb=0, chunk=0, from=1)" in text
    assert "stage 1, instruction #0 recv_activation(mb=0, chunk=0, from=0)" in text
    fixed = _two_stages([_ins(Op.LOAD_MICRO_BATCH), _ins(Op.FORWARD), _ins(Op.SEND_ACTIVATION, peer=1),
                         _ins(Op.RECV_GRAD, peer=1), _ins(Op.BACKWARD)], SECOND_STAGE)
    assert simulate(fixed).makespan == 6


def test_a_receive_nobody_sends_and_a_send_nobody_receives_are_reported():
    no_send = _two_stages([_ins(Op.LOAD_MICRO_BATCH), _ins(Op.FORWARD), _ins(Op.RECV_GRAD, peer=1),
                           _ins(Op.BACKWARD)], SECOND_STAGE[2:4])
    with pytest.raises(ScheduleError, match=r"stage 0, instruction #2 recv_grad.*no stage ever sends it"):
        simulate(no_send)
    no_receive = _two_stages([_ins(Op.LOAD_MICRO_BATCH), _ins(Op.FORWARD), _ins(Op.SEND_ACTIVATION, peer=1)],
                             [_ins(Op.FORWARD)])
    with pytest.raises(ScheduleError, match="activation of micro-batch 0 from virtual stage 0 to virtual stage 1 "
                                            "is sent but no stage receives it"):
        simulate(no_receive)


def test_misused_activations_and_wrong_peers_are_refused():
    with pytest.raises(ScheduleError, match="stage 0, instruction #0 backward.*has not forwarded"):
        simulate(Schedule("x", 1, 1, 1, ((_ins(Op.BACKWARD), _ins(Op.FORWARD)),)))
    with pytest.raises(ScheduleError, match="weight part runs before the input part"):
        simulate(Schedule("x", 1, 1, 1, ((_ins(Op.FORWARD), _ins(Op.BACKWARD_WEIGHT)),)))
    with pytest.raises(ScheduleError, match="names peer 2; the other end is stage 1"):
        simulate(Schedule("x", 3, 1, 1, ((_ins(Op.FORWARD), _ins(Op.SEND_ACTIVATION, peer=2)), (), ())))


def test_bad_sizes_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"micro_batches: a multiple of stages \(4\) .*got 6. Use 4 or 8 micro"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"got 3. Use 4 micro-batches"):
        interleaved_1f1b(4, 3, 2)
    with pytest.raises(ValueError, match="chunks: at least 2 .* Use one_f_one_b"):
        interleaved_1f1b(2, 4, 1)
    with pytest.raises(ValueError, match="stages: a positive int is required; got 0"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match="micro_batches: a positive int is required; got 2.0"):
        gpipe(2, 2.0)  # type: ignore[arg-type]
