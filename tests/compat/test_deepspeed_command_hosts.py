"""The `deepspeed` command of the compatibility package launching a DeepSpeed script over two
network-namespace hosts: `--no_ssh --node_rank=k` (each node started by hand, DeepSpeed's mode for
clusters without ssh) and, where sshd is available, `--hostfile` with ssh fan-out from the first host.
The script must train as it does with two processes on one machine. Skipped, with the reason, where
namespaces (or sshd) cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.run import SCRIPTS, run_script
from tests.distributed.test_launcher import child_env
from tests.distributed.test_multinode_hosts import namespace_hosts

pytestmark = [pytest.mark.timeout(300)]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
ARGS = [str(SCRIPTS / "cifar_style.py"), "--stage", "2", "--deepspeed", "--steps", "4"]


@pytest.fixture(scope="module")
def one_machine() -> dict:
    return run_script("cifar_style.py", *ARGS[1:], world=2, launcher="deepspeed")


def _result(stdout: str) -> dict | None:
    found = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    return found[0] if found else None


def _env() -> dict[str, str]:
    root = str(Path(__file__).parents[2])
    env = child_env()
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], root]))
    return env


def test_no_ssh_each_node_started_by_hand(one_machine, tmp_path_factory, tmp_path):
    with namespace_hosts(tmp_path_factory, "the deepspeed command's --no_ssh test", sshd=False) as hosts:
        hostfile = hosts.hostfile(tmp_path / "hostfile", slots=1)
        nodes = [subprocess.Popen(hosts.in_ns(k, [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh",
                                                  f"--node_rank={k}", f"--master_addr={hosts.addrs[0]}",
                                                  "--master_port=29531", *ARGS]),
                                  cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k in (1, 0)]
        try:
            outputs = [node.communicate(timeout=240) for node in nodes]
        finally:
            for node in nodes:
                node.kill()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-4000:]
    result = _result(outputs[1][0])  # node 0 holds rank 0
    assert result is not None and result["losses"] == pytest.approx(one_machine["losses"], rel=1e-6)


def test_hostfile_over_ssh(one_machine, tmp_path_factory, tmp_path):
    with namespace_hosts(tmp_path_factory, "the deepspeed command's ssh test") as hosts:
        hostfile = hosts.hostfile(tmp_path / "hostfile", slots=1)
        cmd = hosts.in_ns(0, [DEEPSPEED, f"--hostfile={hostfile}", "--launcher=ssh", f"--master_addr={hosts.addrs[0]}",
                              "--master_port=29532", f"--launcher_args=-F {hosts.ssh_config}", *ARGS])
        done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = _result(done.stdout)
    assert result is not None and result["losses"] == pytest.approx(one_machine["losses"], rel=1e-6)
