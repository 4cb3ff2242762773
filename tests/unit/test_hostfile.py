"""Hostfile and --include/--exclude parsing (pure): what is selected, and the message of every mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.launcher.hostfile import HostfileError, Node, parse_filter, parse_hostfile, read_hostfile, select

HOSTS = {"worker-1": 4, "worker-2": 4, "10.0.0.3": 2}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("worker-1 slots=4\nworker-2 slots=2\n", {"worker-1": 4, "worker-2": 2}),
        ("# cluster\n\n  worker-1   slots=4  # big one\n\t\nworker-2 slots=1", {"worker-1": 4, "worker-2": 1}),
        ("10.0.0.1 slots=8\n", {"10.0.0.1": 8}),
        ("node_a.cluster.local slots=2\n", {"node_a.cluster.local": 2}),
    ],
)
def test_valid_hostfiles(text: str, expected: dict[str, int]) -> None:
    parsed = parse_hostfile(text)
    assert parsed == expected and list(parsed) == list(expected)  # order is node-rank order


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker-1 slots=4\nworker-1 slots=2\n",
         "hostfile line 2 ('worker-1 slots=2'): host 'worker-1' is listed twice (first on line 1)"),
        ("worker-1\n", "hostfile line 1 ('worker-1'): expected '<host> slots=<N>'; got 1 field(s)."),
        ("worker-1 4\n", "hostfile line 1 ('worker-1 4'): expected 'slots=<N>' after the host; got '4'."),
        ("worker-1 slots=four\n", "expected 'slots=<N>' after the host; got 'slots=four'."),
        ("worker-1 slots=0\n", "hostfile line 1 ('worker-1 slots=0'): slots must be at least 1; got 0."),
        ("worker-1 slots=2 gpus=2\n", "expected '<host> slots=<N>'; got 3 field(s)."),
        ("-oProxyCommand=x slots=1\n", "host name '-oProxyCommand=x' is not valid"),
        ("a;rm slots=1\n", "host name 'a;rm' is not valid"),
        ("# only a comment\n\n", "hostfile: no hosts found; expected lines like 'worker-1 slots=4'."),
    ],
)
def test_malformed_hostfiles_quote_the_line(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as error:
        parse_hostfile(text)
    assert message in str(error.value)


def test_missing_hostfile_is_named(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="--hostfile .*nope: no such file"):
        read_hostfile(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ("", "", [("worker-1", (0, 1, 2, 3)), ("worker-2", (0, 1, 2, 3)), ("10.0.0.3", (0, 1))]),
        ("worker-2", "", [("worker-2", (0, 1, 2, 3))]),
        ("worker-1:0,2@10.0.0.3", "", [("worker-1", (0, 2)), ("10.0.0.3", (0, 1))]),
        ("10.0.0.3@worker-1:3", "", [("worker-1", (3,)), ("10.0.0.3", (0, 1))]),  # hostfile order is kept
        ("", "worker-1", [("worker-2", (0, 1, 2, 3)), ("10.0.0.3", (0, 1))]),
        ("", "worker-1:1,3@10.0.0.3:0", [("worker-1", (0, 2)), ("worker-2", (0, 1, 2, 3)), ("10.0.0.3", (1,))]),
    ],
)
def test_filters_select_hosts_and_slots(include: str, exclude: str, expected: list[tuple[str, tuple[int, ...]]]) -> None:
    assert select(HOSTS, include, exclude) == tuple(Node(h, s) for h, s in expected)


def test_num_nodes_and_num_gpus_limit_the_selection() -> None:
    assert select(HOSTS, num_nodes=2, num_slots=2) == (Node("worker-1", (0, 1)), Node("worker-2", (0, 1)))
    assert select(HOSTS, exclude="worker-1:0", num_slots=1)[0] == Node("worker-1", (1,))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "worker-9"}, "--include: host 'worker-9' is not in the hostfile (hosts: worker-1, worker-2, 10.0.0.3)."),
        ({"exclude": "worker-1:4"}, "--exclude: host 'worker-1' has slots 0-3; there is no slot 4."),
        ({"include": "worker-1", "exclude": "worker-2"}, "--include and --exclude cannot be used together"),
        ({"include": "worker-1:0,x"}, "slots must be comma-separated numbers like 'host:0,1'; got '0,x'."),
        ({"include": "worker-1:"}, "slots must be comma-separated numbers like 'host:0,1'; got ''."),
        ({"include": "worker-1@worker-1:0"}, "host 'worker-1' appears twice"),
        ({"include": "worker-1:1,1"}, "slot listed twice"),
        ({"include": "@worker-1"}, "a host name is missing"),
        ({"exclude": "worker-1@worker-2@10.0.0.3"}, "--exclude: no slots are left on any host; nothing to run."),
        ({"num_nodes": 4}, "--num_nodes 4: must be between 1 and the 3 host(s) available."),
        ({"num_slots": 3}, "--num_gpus 3: must be at least 1 and at most the slots of every host; too few on 10.0.0.3."),
        ({"include": "bad host"}, "host name 'bad host' is not valid"),
    ],
)
def test_filter_mistakes_are_explained(kwargs: dict, message: str) -> None:
    with pytest.raises(HostfileError) as error:
        select(HOSTS, **kwargs)
    assert message in str(error.value)


def test_filter_terms_parse_to_host_slot_lists() -> None:
    assert parse_filter("a:0,1@b", "--include") == {"a": (0, 1), "b": None}
