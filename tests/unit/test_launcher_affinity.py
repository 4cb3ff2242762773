"""``--bind_cores_to_rank`` / ``--bind_core_list``: which cores each rank gets (pure; nothing is pinned)."""

from __future__ import annotations

import pytest

from shardwise.launcher.affinity import (CoreBindingError, format_core_list, node_cores, one_per_physical_core,
                                         parse_core_list, rank_share)


def test_core_lists_read_as_deepspeed_writes_them() -> None:
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    assert parse_core_list("0") == [0]
    assert format_core_list([5, 0, 1, 2]) == "0-2,5"


@pytest.mark.parametrize(("text", "message"), [
    ("3-1", "item '3-1' is out of order or overlaps an earlier one"),
    ("0-3,2", "item '2' is out of order or overlaps an earlier one"),
    ("0, 1", "item ' 1' is not a core number or a range like '4-7'"),
    ("", "item '' is not a core number"),
    ("a-b", "item 'a-b' is not a core number"),
])
def test_malformed_core_lists_are_quoted(text: str, message: str) -> None:
    with pytest.raises(CoreBindingError, match=f"--bind_core_list {text!r}: " + message.replace("(", r"\(")):
        parse_core_list(text)


def test_each_rank_gets_an_equal_consecutive_share() -> None:
    cores = list(range(8))
    assert [rank_share(cores, 3, r) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]  # 6, 7 stay unused
    assert rank_share([0, 2, 4, 6], 2, 1) == [4, 6]
    with pytest.raises(CoreBindingError, match=r"1 core\(s\) \(3\) for 2 ranks on this node; each rank needs"):
        rank_share([3], 2, 0)


def test_hyperthread_siblings_count_once() -> None:
    # cpus 0/2 and 1/3 are two hardware threads of cores (0, 0) and (0, 1); cpu 5's topology is unknown
    topology = {0: ("0", "0"), 1: ("0", "1"), 2: ("0", "0"), 3: ("0", "1"), 5: None}
    assert one_per_physical_core([3, 2, 1, 0, 5], topology.get) == [0, 1, 5]


def test_listed_cores_must_be_usable_here() -> None:
    assert node_cores("1-2", allowed={0, 1, 2, 3}) == [1, 2]
    with pytest.raises(CoreBindingError, match=r"core\(s\) 4,6 are not available to this process \(it may use 0-3\)"):
        node_cores("2,4,6", allowed={0, 1, 2, 3})
