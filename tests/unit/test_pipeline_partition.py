"""The pure pieces of pipeline parallelism: how layers split into parts (partition.py), where ranks sit on a
pipe × data mesh (ProcessTopology, laid out as DeepSpeed lays it out), the description of a stage's output
that crosses once ahead of the payloads (p2p.Meta), and the tags under which StageLink sends and receives
(every schedule's sends meet their receives, through a mailbox standing in for the collectives)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from shardwise.distributed.topology import Group, PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from shardwise.pipeline import Op, gpipe, inference, interleaved_1f1b, one_f_one_b, partition
from shardwise.pipeline.p2p import HEADER, Meta, StageLink


# --- partition ------------------------------------------------------------------------------------
def _part_sums(weights: list[int], bounds: list[int]) -> list[int]:
    return [sum(weights[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


def _optimal_partitions(weights: list[int], parts: int) -> tuple[int, list[list[int]]]:
    """Every contiguous split into non-empty parts, by brute force: the smallest largest part, and the splits
    that reach it."""
    n = len(weights)
    splits = [[0, *cuts, n] for cuts in itertools.combinations(range(1, n), parts - 1)]
    best = min(max(_part_sums(weights, b)) for b in splits)
    return best, [b for b in splits if max(_part_sums(weights, b)) == best]


def _check_bounds(bounds: list[int], num_layers: int, parts: int) -> None:
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == num_layers
    assert all(hi > lo for lo, hi in itertools.pairwise(bounds)), f"an empty part in {bounds}"


def test_uniform_gives_the_first_parts_one_more_layer():
    assert partition.uniform(10, 3) == [0, 4, 7, 10]
    assert partition.uniform(8, 2) == [0, 4, 8]
    assert partition.uniform(3, 3) == [0, 1, 2, 3]
    assert partition.uniform(5, 1) == [0, 5]
    for layers, parts in itertools.product(range(1, 12), range(1, 12)):
        if layers >= parts:
            bounds = partition.uniform(layers, parts)
            _check_bounds(bounds, layers, parts)
            sizes = [hi - lo for lo, hi in itertools.pairwise(bounds)]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_balanced_examples():
    assert partition.balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition.balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert partition.balanced([1, 1, 1, 1, 1], 2) == [0, 3, 5]  # earlier parts take as much as they can
    assert partition.balanced([0, 0, 0, 0], 3) == [0, 2, 3, 4]  # all-zero weights: still one layer per part
    assert partition.balanced([0, 0, 7], 3) == [0, 1, 2, 3]
    # tests/pipeline_models.py's model at 4 stages: Linear(8,16) 144, six Blocks of 304, Head 68 parameters
    assert partition.balanced([144, *[304] * 6, 68], 4) == [0, 2, 4, 6, 8]
    assert partition.balanced([144, *[304] * 5, 68], 2) == [0, 3, 7]


def test_balanced_minimises_the_largest_part_like_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        weights = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 100]) for _ in range(n)]
        parts = rng.randint(1, n)
        bounds = partition.balanced(weights, parts)
        _check_bounds(bounds, n, parts)
        best, optimal = _optimal_partitions(weights, parts)
        assert max(_part_sums(weights, bounds)) == best, (weights, parts, bounds)
        assert bounds == max(optimal), (weights, parts, bounds)  # among the optimal, the earliest parts fullest


def test_type_weights_match_class_names_case_insensitively_anywhere():
    names = ["Embedding", "TransformerBlock", "transformerblock", "LayerNorm", "Head"]
    assert partition.type_weights(names, "transformer") == [0, 1, 1, 0, 0]
    assert partition.type_weights(names, "^(embedding|head)$") == [1, 0, 0, 0, 1]
    weights = partition.type_weights(["Linear", *["Block"] * 6, "Head"], "block")
    assert partition.balanced(weights, 4) == [0, 3, 5, 7, 8]


@pytest.mark.parametrize("call, message", [
    (lambda: partition.uniform(2, 3),
     ("the model has 2 layers, fewer than the 3 pipeline parts asked for; every part needs at least one layer. "
      "Use fewer stages (or chunks), or split the model finer.")),
    (lambda: partition.balanced([1, 2], 3), "the model has 2 layers, fewer than the 3 pipeline parts asked for"),
    (lambda: partition.uniform(4, 0), "parts: at least 1 is required; got 0."),
    (lambda: partition.balanced([1, -1, 2], 2), "weights: non-negative values are required; got [1, -1, 2]."),
    (lambda: partition.type_weights(["Block"], "("), 'partition_method: "type:(" is not a valid regular expression'),
    (lambda: partition.type_weights(["Linear", "Block", "Block"], "attention"),
     ("partition_method: \"type:attention\" matches no layer class (classes: ['Block', 'Linear']); name a class "
      "that the layers have.")),
])
def test_partition_errors(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


# --- topology -----------------------------------------------------------------------------------------
def test_pipe_data_topology_is_pipe_major_like_deepspeeds():
    # the expected values are what deepspeed.runtime.pipe.topology.PipeDataParallelTopology(2, 3) answers
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.world_size() == 6 and topo.get_axis_names() == ["pipe", "data"]
    assert (topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("tensor")) == (2, 3, 1)
    assert [topo.get_rank(pipe=p, data=d) for p in range(2) for d in range(3)] == [0, 1, 2, 3, 4, 5]
    assert topo.get_coord(4) == {"pipe": 1, "data": 1}
    assert all(topo.get_rank(**topo.get_coord(r)) == r for r in range(6))
    assert topo.filter_match(pipe=0) == [0, 1, 2]
    assert topo.filter_match(data=1) == [1, 4]
    assert topo.filter_match(pipe=1, data=2) == [5]
    assert topo.get_axis_list("pipe", 1) == [3, 4, 5]
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]  # each data replica's pipeline
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]  # each stage's replicas
    assert topo.get_axis_comm_lists("tensor") == []


def test_three_axis_topology_varies_the_last_axis_fastest():
    topo = ProcessTopology(["pipe", "data", "tensor"], [2, 2, 2])
    for p, d, t in itertools.product(range(2), repeat=3):
        assert topo.get_rank(pipe=p, data=d, tensor=t) == (p * 2 + d) * 2 + t
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("axes, dims, message", [
    (["pipe"], [2, 2], "axes ['pipe'] and dims [2, 2]: one positive size per axis is required."),
    (["pipe", "data"], [2, 0], "axes ['pipe', 'data'] and dims [2, 0]: one positive size per axis is required."),
    (["pipe", "expert"], [2, 2], "axes: only pipe, data, tensor exist in shardwise's mesh; got ['expert']."),
])
def test_topology_errors(axes, dims, message):
    with pytest.raises(ValueError) as info:
        ProcessTopology(axes, dims)
    assert str(info.value) == message


def test_model_axis_is_the_tensor_axis_in_deepspeeds_order():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_get_rank_needs_every_axis():
    with pytest.raises(ValueError) as info:
        PipeDataParallelTopology(num_pp=2, num_dp=2).get_rank(pipe=1)
    assert str(info.value) == "get_rank: every axis (pipe, data) is required; got ['pipe']."


# --- the activation description -----------------------------------------------------------------------------
def _round_trip(value) -> Meta:
    header = Meta.of(value).encode()
    assert header.dtype == torch.int64 and header.shape == (HEADER,)
    return Meta.decode(header)


def test_meta_round_trips_a_tensor():
    x = torch.randn(3, 5, requires_grad=True)
    meta = _round_trip(x)
    assert meta == Meta.of(x)
    assert meta == Meta(False, ((torch.float32, True, (3, 5)),))


def test_meta_round_trips_a_tuple_of_mixed_dtypes_and_grad_flags():
    value = (torch.randn(2, 4, 6, requires_grad=True), torch.zeros(2, 4, dtype=torch.int64),
             torch.ones(7, dtype=torch.bool), torch.randn(2, dtype=torch.bfloat16),
             torch.tensor(3.0, dtype=torch.float16),
             torch.zeros(1, 2, 3, 4, dtype=torch.uint8))
    meta = _round_trip(value)
    assert meta.is_tuple
    assert meta.tensors == ((torch.float32, True, (2, 4, 6)), (torch.int64, False, (2, 4)), (torch.bool, False, (7,)),
                            (torch.bfloat16, False, (2,)), (torch.float16, False, ()),
                            (torch.uint8, False, (1, 2, 3, 4)))
    assert meta.describe() == "float32[2, 4, 6], int64[2, 4], bool[7], bfloat16[2], float16[], uint8[1, 2, 3, 4]"


def test_meta_tells_a_one_tuple_from_a_tensor():
    x = torch.randn(2, 3)
    assert _round_trip((x,)).is_tuple and not _round_trip(x).is_tuple
    assert _round_trip((x,)) != _round_trip(x)


def test_meta_differs_when_a_shape_or_dtype_changes():
    assert Meta.of(torch.zeros(2, 16)) != Meta.of(torch.zeros(3, 16))
    assert Meta.of(torch.zeros(2, 16)) != Meta.of(torch.zeros(2, 16, dtype=torch.float16))
    assert Meta.of(torch.zeros(2, 16)) != Meta.of(torch.zeros(2, 16, requires_grad=True))


def test_meta_header_too_long():
    assert _round_trip(tuple(torch.zeros(()) for _ in range(20))).tensors == ((torch.float32, False, ()),) * 20
    with pytest.raises(ValueError) as info:  # 2 + 21 × 3 slots
        Meta.of(tuple(torch.zeros(()) for _ in range(21))).encode()
    assert str(info.value) == ("a pipeline stage's output of 21 tensors needs 65 header slots, more than 64; return "
                               "fewer tensors (concatenate them).")


def test_meta_refuses_what_is_not_a_tensor():
    with pytest.raises(TypeError) as info:
        Meta.of((torch.zeros(2), 3))
    assert str(info.value) == ("a pipeline stage's output must be a tensor or a tuple of tensors; item 1 is a int. "
                               "Return tensors only (pass other values as tensors).")
    with pytest.raises(TypeError) as info:
        Meta.of([torch.zeros(2)])
    assert "item 0 is a list" in str(info.value)


def test_meta_refuses_a_dtype_stages_cannot_exchange():
    with pytest.raises(TypeError) as info:
        Meta.of((torch.zeros(2), torch.zeros(2, dtype=torch.complex64)))
    message = "output item 1 has dtype torch.complex64, which stages cannot exchange; use one of ['float32',"
    assert message in str(info.value)


# --- every send meets its receive (tags) --------------------------------------------------------------------
class _NotYet(Exception):
    pass


class _Done:
    def wait(self) -> None:
        pass


class _Mailbox:
    """Stands in for Collectives: a send leaves a copy under (from, to, tag); a receive takes the oldest, or
    raises _NotYet when nothing with its tag has been sent (gloo matches sends to receives by tag)."""

    def __init__(self) -> None:
        self.boxes: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def send(self, tensor, peer, group, tag):
        self.boxes.setdefault((group.rank, peer, tag), []).append(tensor.clone())
        return _Done()

    def recv(self, tensor, peer, group, tag):
        waiting = self.boxes.get((peer, group.rank, tag))
        if not waiting:
            raise _NotYet
        tensor.copy_(waiting.pop(0))
        return _Done()


def _exchange(link, ins) -> None:
    activation = torch.zeros(2, 3)
    if ins.op is Op.SEND_ACTIVATION:
        link.send_activation(activation, ins.peer, ins.micro_batch, ins.chunk)
    elif ins.op is Op.RECV_ACTIVATION:
        assert Meta.of(link.recv_activation(ins.peer, ins.micro_batch, ins.chunk)) == Meta.of(activation)
    elif ins.op is Op.SEND_GRAD:
        link.send_grads([activation], ins.peer, ins.micro_batch, ins.chunk)
    elif ins.op is Op.RECV_GRAD:
        link.recv_grads([activation], ins.peer, ins.micro_batch, ins.chunk)


def _run_links(schedule) -> tuple[list[int], _Mailbox]:
    """Every stage's StageLink through its instructions, round robin, each stage until a receive must wait."""
    stages, mailbox = schedule.stages, _Mailbox()
    links = [StageLink(mailbox, Group("pipe", None, stages, s), list(range(stages)), torch.device("cpu"))
             for s in range(stages)]
    done, progressed = [0] * stages, True
    while progressed:
        progressed = False
        for stage, instructions in enumerate(schedule.per_stage):
            while done[stage] < len(instructions):
                try:
                    _exchange(links[stage], instructions[done[stage]])
                except _NotYet:
                    break
                done[stage] += 1
                progressed = True
    return done, mailbox


def _schedules():
    for stages, micro_batches in itertools.product(range(1, 5), range(1, 9)):
        yield one_f_one_b(stages, micro_batches)
        yield gpipe(stages, micro_batches)
        yield inference(stages, micro_batches)
        if micro_batches % stages == 0:
            yield interleaved_1f1b(stages, micro_batches, 2)
            yield interleaved_1f1b(stages, micro_batches, 3)


def test_every_send_is_received_under_the_tag_it_was_sent_with():
    # interleaved: stage 0's chunk c receives from the last stage's chunk c - 1, and sends that chunk its gradient
    for schedule in _schedules():
        done, mailbox = _run_links(schedule)
        label = f"{schedule.name}, {schedule.stages} stages, {schedule.micro_batches} micro-batches"
        assert done == [len(i) for i in schedule.per_stage], f"{label}: stuck at {done}"
        assert not any(mailbox.boxes.values()), f"{label}: never received: {[k for k, v in mailbox.boxes.items() if v]}"
