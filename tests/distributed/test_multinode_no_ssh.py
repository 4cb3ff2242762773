"""``--no_ssh``: the user starts the launcher on every node with its ``--node_rank`` (DeepSpeed's mode for
clusters without ssh between nodes). Two network-namespace hosts, no sshd: the test is what starts each node.
Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.test_launcher import LAUNCH_TIMEOUT_S, WORKER, child_env
from tests.distributed.test_multinode_hosts import Hosts, namespace_hosts

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with namespace_hosts(tmp_path_factory, "--no_ssh tests", sshd=False) as made:
        yield made


def start_node(hosts: Hosts, node: int, args: list[str], cwd: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "shardwise.cli", *args]
    return subprocess.Popen(hosts.in_ns(node, cmd), cwd=cwd, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_each_node_started_by_hand_joins_one_job(hosts: Hosts, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    hostfile = hosts.hostfile(tmp_path / "hostfile", slots=1)
    # DeepSpeed's command for node k, as a user runs it on that node; the master is the first host.
    nodes = [start_node(hosts, k, ["--hostfile", str(hostfile), "--no_ssh", f"--node_rank={k}",
                                   f"--master_addr={hosts.addrs[0]}", "--master_port=29500", str(worker), "--x"],
                        tmp_path) for k in (1, 0)]
    try:
        outputs = [node.communicate(timeout=LAUNCH_TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-4000:]
    # Node 1's launcher printed rank 1 only, node 0's rank 0: each started just its own node's ranks.
    (rank1,), (rank0,) = ([json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outputs)
    got = [(r["rank"], r["world"], r["sum"], r["local_rank_env"]) for r in (rank0, rank1)]
    assert got == [(0, 2, 3.0, 0), (1, 2, 3.0, 0)]
    assert rank1["argv"] == ["--local_rank=0", "--x"]
    assert rank1["env"]["MASTER_ADDR"] == hosts.addrs[0]
