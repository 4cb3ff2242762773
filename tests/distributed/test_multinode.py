"""Multi-node launching for real: two hosts made of network namespaces, each with its own sshd.

``shardwise --hostfile`` with the ssh and pdsh runners trains TinyNet on 2 nodes × 2 processes; the losses
must equal the single-node 4-process run's. Then the failure paths: a rank SIGKILLed on host 2, the launcher
SIGKILLed, one node's agent SIGKILLed — after each, no process of the job may be left on any host (every
process notes its pid with ``--save_pid``). Skipped, with the reason, where namespaces or sshd are missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.test_multinode_hosts import Hosts, namespace_hosts

pytestmark = [pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120
STEPS = 4

TRAIN = textwrap.dedent(
    '''
    """Multi-node test job: TinyNet under shardwise; rank 0 writes the losses. With --progress DIR every rank
    trains until stopped, writing its step to DIR/rank<R> (for the failure tests)."""
    import argparse, json, os, time
    import torch
    from tests.parity import ds_config, engine_run, make_model, micro_batch, param_groups

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--label")
    parser.add_argument("--progress")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.progress:
        import shardwise
        model = make_model()
        engine, _, _, _ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=ds_config(2, 1))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        for step in range(100000):
            engine.backward(engine(*micro_batch(step, 0, rank, 2, 1, world)))
            engine.step()
            with open(os.path.join(args.progress, f"rank{rank}"), "w") as f:
                f.write(str(step))
            time.sleep(0.2)
    losses, _, _ = engine_run(ds_config(micro=2, accum=1), args.steps)
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "world": int(os.environ["WORLD_SIZE"]), "label": args.label}, f)
    '''
)


def child_env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("PET_", "TORCHELASTIC_", "SLURM_", "OMPI_"))}
    # Carried to every node by the launcher (PYTHONPATH is one of the carried variables).
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}", **extra)
    return env


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with namespace_hosts(tmp_path_factory, "multi-node tests") as made:
        yield made


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("job")
    (directory / "train.py").write_text(TRAIN)
    return directory


def launcher_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli", *args]


def run_ok(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-6000:]}"
    return result


def _train_losses(steps: int) -> list[float]:
    from tests.parity import ds_config, engine_run

    return engine_run(ds_config(micro=2, accum=1), steps)[0]


@pytest.fixture(scope="module")
def single_node_losses() -> list[float]:
    """The reference: the same training as one node × 4 processes (forked by the harness: no start-up cost)."""
    from tests.harness import run_distributed

    return run_distributed(_train_losses, 4, STEPS)[0]


def ssh_args(hosts: Hosts, runner: str) -> tuple[list[str], dict[str, str]]:
    if runner == "ssh":
        return ["--launcher", "ssh", "--launcher_args", f"-F {hosts.ssh_config}"], child_env()
    return ["--launcher", "pdsh"], child_env(PDSH_SSH_ARGS_APPEND=f"-F {hosts.ssh_config}")


@pytest.mark.parametrize("runner", ["ssh", "pdsh"])
def test_two_nodes_train_like_one(runner: str, hosts: Hosts, job: Path, single_node_losses: list[float]) -> None:
    from tests.parity import oracle

    out, (args, env) = job / f"{runner}.json", ssh_args(hosts, runner)
    label = "spaces and $HOME; `shell` 'quotes'"
    cmd = launcher_cmd([*args, "--hostfile", str(hosts.hostfile(job / "hostfile")), "train.py", "--out", str(out),
                        "--label", label])
    run_ok(hosts.in_ns(0, cmd), job, env)
    got = json.loads(out.read_text())
    assert got["world"] == 4 and got["label"] == label  # the argument reached every rank intact
    assert got["losses"] == pytest.approx(single_node_losses, rel=1e-6)
    assert got["losses"] == pytest.approx(oracle(STEPS, 8)[0], rel=1e-5)


class RunningJob:
    """A long-running 2 × 2 job; knows every pid of the job from its --save_pid file."""

    def __init__(self, hosts: Hosts, job: Path, runner: str, slots: int) -> None:
        self.ranks = 2 * slots
        self.progress = job / f"progress-{runner}-{time.monotonic_ns()}"
        self.progress.mkdir()
        args, env = ssh_args(hosts, runner)
        hostfile = hosts.hostfile(job / f"hostfile{slots}", slots=slots)
        cmd = launcher_cmd([*args, "--save_pid", "--hostfile", str(hostfile), "train.py",
                            "--progress", str(self.progress)])
        self.proc = subprocess.Popen(hosts.in_ns(0, cmd), cwd=job, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.pid_file = Path(f"/tmp/{self.proc.pid}.shardwise")  # `ip netns exec` execs: same pid

    def wait_training(self) -> dict[str, int]:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(list(self.progress.iterdir())) < self.ranks:
            assert self.proc.poll() is None, f"job ended early:\n{self.proc.communicate()[1][-4000:]}"
            assert time.monotonic() < deadline, "job did not start training"
            time.sleep(0.2)
        return self.pids()

    def pids(self) -> dict[str, int]:
        lines = [line.split() for line in self.pid_file.read_text().splitlines()]
        return {f"{role} {host}": int(pid) for role, host, pid in lines}

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            pytest.fail(f"the launcher did not exit within {timeout} s:\n{err[-4000:]}")
        return self.proc.returncode, err

    def cleanup(self) -> None:
        for pid in self.pids().values():
            _kill(pid)
        self.pid_file.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def wait_all_gone(pids: dict[str, int], within: float) -> list[str]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = [name for name, pid in pids.items() if _alive(pid)]
        if not left:
            return []
        time.sleep(0.2)
    return [f"{name} (pid {pids[name]})" for name, pid in pids.items() if _alive(pid)]


@pytest.fixture
def running(hosts: Hosts, job: Path, request: pytest.FixtureRequest) -> Iterator[RunningJob]:
    runner, slots = request.param
    started = RunningJob(hosts, job, runner, slots)
    yield started
    started.cleanup()


@pytest.mark.parametrize("running", [("pdsh", 2)], indirect=True)
def test_killed_rank_on_second_host_stops_the_job_everywhere(running: RunningJob, hosts: Hosts) -> None:
    pids = running.wait_training()
    victim = pids[f"rank3 {hosts.addrs[1]}"]
    os.kill(victim, signal.SIGKILL)
    code, err = running.finish(timeout=30)
    assert code != 0
    assert f"shardwise: rank 3 on host {hosts.addrs[1]} (local rank 1, pid {victim}) failed first, with signal 9 (SIGKILL)" in err, err[-4000:]
    assert "The job was stopped on all 2 node(s)." in err
    assert wait_all_gone(pids, within=10) == []


# One rank per host is enough to show that nothing is orphaned (and halves the start-up on two cores).
@pytest.mark.parametrize("running", [("ssh", 1)], indirect=True)
def test_sigkilled_launcher_leaves_no_process_on_any_host(running: RunningJob) -> None:
    pids = running.wait_training()
    os.kill(pids[next(k for k in pids if k.startswith("launcher"))], signal.SIGKILL)
    assert wait_all_gone(pids, within=10) == []


# One rank per host is enough to show that nothing is orphaned (and halves the start-up on two cores).
@pytest.mark.parametrize("running", [("ssh", 1)], indirect=True)
def test_sigkilled_node_agent_leaves_no_process_on_any_host(running: RunningJob, hosts: Hosts) -> None:
    pids = running.wait_training()
    os.kill(pids[f"agent {hosts.addrs[1]}"], signal.SIGKILL)
    assert wait_all_gone(pids, within=10) == []
    code, err = running.finish(timeout=10)
    assert code == 1 and f"the node agent of node 1 ({hosts.addrs[1]}) was lost" in err, err[-4000:]
