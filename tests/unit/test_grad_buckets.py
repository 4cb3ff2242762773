"""Partitioned gradient buckets: full buffers come from a pool, and go back as soon as their reduction completes."""

from __future__ import annotations

import torch

from shardwise.zero.flat_param import plan_buckets
from shardwise.zero.grad_buckets import OVERLAP_BUCKET_BYTES, Bucket, FlatPool, GradBuckets, bucket_numel
from shardwise.zero.reducers import Reduction


def test_bucket_size_is_the_configured_limit_capped_for_overlap() -> None:
    assert bucket_numel(1000, torch.float32) == 1000
    assert bucket_numel(500_000_000, torch.float32) == OVERLAP_BUCKET_BYTES // 4
    assert bucket_numel(500_000_000, torch.bfloat16) == OVERLAP_BUCKET_BYTES // 2


def test_deepspeeds_default_bucket_size_still_splits_a_model_larger_than_the_cap() -> None:
    cap = OVERLAP_BUCKET_BYTES // 4
    params = [torch.nn.Parameter(torch.empty(cap // 2)) for _ in range(5)]
    buckets = GradBuckets.replicated(params, 500_000_000, torch.float32, FakeReducer(True))
    assert [len(b.params) for b in buckets.buckets] == [2, 2, 1]
    assert buckets.buckets[0].params[0] is params[-1]  # backward order: the last parameter's bucket fills first
    buckets.remove_hooks()


def test_pool_reuses_a_buffer_best_fit_and_zeroed() -> None:
    pool = FlatPool()
    small, large = pool.take(4, torch.float32, torch.device("cpu")), pool.take(8, torch.float32, torch.device("cpu"))
    small.fill_(1.0)
    large.fill_(1.0)
    pool.give(large)
    pool.give(small)
    again = pool.take(3, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == small.data_ptr() and again.numel() == 3 and not again.any()
    assert pool.take(8, torch.bfloat16, torch.device("cpu")).data_ptr() != large.data_ptr()  # dtype must match
    pool.give(again)
    assert pool.take(4, torch.float32, torch.device("cpu")).data_ptr() == small.data_ptr()  # a view gives back its base


def test_pool_keeps_nothing_off_cpu() -> None:
    pool = FlatPool()
    pool.give(torch.empty(4, device="meta"))
    assert pool._free == []


class FakeReducer:
    """Sums nothing; its reductions report done as `completes_at_once` says, and record when they finish."""

    rereduce_safe = True

    def __init__(self, completes_at_once: bool):
        self.completes_at_once = completes_at_once
        self.finished: list[int] = []

    def launch(self, bucket: Bucket) -> Reduction:
        reducer = self

        class _Pending:
            def done(self) -> bool:
                return reducer.completes_at_once

            def wait(self) -> None:
                pass

        return Reduction(_Pending(), lambda: self.finished.append(bucket.flat.data_ptr()))


def _one_bucket_per_layer(layers: int) -> tuple[torch.nn.Sequential, list[Bucket]]:
    """Layers of 16 weights, one partitioned bucket each, in gradient arrival order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(layers)))
    params = list(reversed(list(model.parameters())))
    return model, [Bucket(layout, [p], torch.float32, (0, layout.padded_numel), partitioned=True)
                   for layout, p in zip(plan_buckets([p.numel() for p in params], 16), params)]


def _three_buckets(completes_at_once: bool) -> tuple[torch.nn.Sequential, GradBuckets, FakeReducer]:
    model, buckets = _one_bucket_per_layer(3)
    reducer = FakeReducer(completes_at_once)
    return model, GradBuckets(buckets, reducer, overlap=True), reducer


def _backward(model: torch.nn.Sequential, buckets: GradBuckets) -> None:
    buckets.begin(reduce=True)
    model(torch.ones(2, 4)).sum().backward()
    buckets.finish()


def test_a_completed_reduction_frees_its_buffer_for_the_next_bucket_during_backward() -> None:
    model, buckets, reducer = _three_buckets(completes_at_once=True)
    _backward(model, buckets)
    assert len(set(reducer.finished)) == 1  # one buffer served all three buckets in turn
    assert all(b.flat is None for b in buckets.buckets)
    _backward(model, buckets)
    assert set(reducer.finished) == {reducer.finished[0]}  # and the next step, without a new allocation


def test_buffers_in_flight_at_once_are_distinct_and_kept_for_the_next_step() -> None:
    model, buckets, reducer = _three_buckets(completes_at_once=False)
    _backward(model, buckets)
    first = list(reducer.finished)
    assert len(set(first)) == 3
    _backward(model, buckets)
    assert set(reducer.finished[3:]) == set(first)


def test_at_most_max_in_flight_reductions_so_staging_memory_is_bounded() -> None:
    """Reductions that never finish by themselves (a slow network): launching a third waits for the oldest, so
    the full buffers live at once are the two in flight and the one filling, not one per bucket."""
    from shardwise.zero.grad_buckets import MAX_IN_FLIGHT

    model, buckets = _one_bucket_per_layer(6)
    reducer = FakeReducer(completes_at_once=False)
    grads = GradBuckets(buckets, reducer, overlap=True)
    seen: list[int] = []
    launch = reducer.launch
    reducer.launch = lambda bucket: (seen.append(len(grads._in_flight)), launch(bucket))[1]
    _backward(model, grads)
    assert max(seen) == MAX_IN_FLIGHT - 1 == 1  # in flight before each launch: never more than one other
    assert len(set(reducer.finished)) == MAX_IN_FLIGHT + 1


def test_launch_groups_are_fixed_runs_of_consecutive_buckets() -> None:
    from shardwise.zero.grad_buckets import plan_launch_groups

    assert plan_launch_groups([16] * 7, 40) == [3, 3, 3, 6, 6, 6, 7]  # closed once they hold 40; the rest alone
    assert plan_launch_groups([16] * 3, 0) == [1, 2, 3]  # 0: every bucket alone
    assert plan_launch_groups([50, 1, 1], 40) == [1, 3, 3]
    assert plan_launch_groups([], 40) == []


def test_grouped_buckets_launch_together_once_the_last_completes_and_groups_bound_what_is_in_flight() -> None:
    """Reductions that never finish by themselves: each launch is one group of three buckets, issued when its
    last bucket's gradients arrive, and a group waits for the oldest in flight as a single bucket did."""
    from shardwise.zero.grad_buckets import MAX_IN_FLIGHT

    model, buckets = _one_bucket_per_layer(9)
    reducer = FakeReducer(completes_at_once=False)
    grads = GradBuckets(buckets, reducer, overlap=True, coalesce_numel=40)
    launched: list[tuple[list[int], int, int]] = []  # (buckets, groups in flight, gradients still to come)

    def launch_many(group: list[Bucket]) -> list[Reduction]:
        launched.append(([buckets.index(b) for b in group], len(grads._in_flight), sum(b.waiting for b in buckets)))
        return [reducer.launch(b) for b in group]

    reducer.launch_many = launch_many
    _backward(model, grads)
    assert [g for g, _, _ in launched] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [left for _, _, left in launched] == [6, 3, 0]  # during backward, as soon as each group is complete
    assert max(n for _, n, _ in launched) == MAX_IN_FLIGHT - 1
    assert len(reducer.finished) == 9 and all(b.flat is None for b in buckets)


class RecordingReducer(FakeReducer):
    """Keeps a copy of each launched buffer: what the reduction would have summed."""

    def __init__(self) -> None:
        super().__init__(completes_at_once=True)
        self.sent: list[torch.Tensor] = []

    def launch(self, bucket: Bucket) -> Reduction:
        self.sent.append(bucket.flat.clone())
        return super().launch(bucket)


def test_a_reused_buffer_is_sent_with_this_steps_gradients_zeros_where_none_came_and_zero_padding() -> None:
    """[Note: buffers are not zeroed]: the pool hands back a buffer full of the last step's values (nan here);
    what is reduced must be exactly this micro-step's gradients, an unused parameter's slot and the padding
    zeros, and a gradient adopted with a scale, then added to by backward, the scaled sum."""
    torch.manual_seed(0)
    used, unused, adopted = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    layout = plan_buckets([3, 3, 3], 64, align=4)[0]  # 9 elements padded to 12
    bucket = Bucket(layout, [used, unused, adopted], torch.float32, (0, layout.padded_numel), partitioned=True)
    reducer = RecordingReducer()
    grads = GradBuckets([bucket], reducer, overlap=True)
    bucket.pool.give(torch.full((layout.padded_numel,), float("nan")))
    adopted.grad = torch.full((3,), 2.0)
    grads.loose = True
    assert grads.adopt(scale=0.5) == 1
    grads.begin(reduce=True)
    (used * 3.0).sum().backward()
    (adopted * 4.0).sum().backward()
    grads.finish()
    assert layout.padded_numel == 12
    expected = torch.tensor([3.0] * 3 + [0.0] * 3 + [1.0 + 4.0] * 3 + [0.0] * 3)
    assert torch.equal(reducer.sent[0], expected)
    grads.remove_hooks()
