"""``--elastic_training``: a failed rank or a lost node is brought back by the elastic agents' restart policy,
and training resumes from the last checkpoint with the losses of an uninterrupted run.

The job checkpoints every step and resumes from ``latest`` whenever it starts. One node (the local launcher,
an agent restarting its workers) always runs; two nodes need the network-namespace hosts of
``test_multinode_hosts`` and skip, with the reason, without them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.test_multinode import RUN_TIMEOUT_S, _kill as kill_if_alive, child_env, launcher_cmd, ssh_args
from tests.distributed.test_multinode_hosts import Hosts, namespace_hosts

pytestmark = [pytest.mark.timeout(300)]

STEPS = 6

TRAIN = textwrap.dedent(
    '''
    """Elastic test job: a checkpoint after every step, resumed from at start. On the first attempt rank
    --die_rank SIGKILLs itself after step --die_after. Rank 0 appends one JSON line per step to --out."""
    import argparse, json, os, signal, time
    import torch
    import shardwise
    from tests.parity import ds_config, make_model, param_groups, train_steps

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--ckpt")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--die_after", type=int, default=-1)
    parser.add_argument("--die_rank", type=int, default=1)
    parser.add_argument("--step_sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=ds_config(2, 1))
    start = 0
    if os.path.exists(os.path.join(args.ckpt, "latest")):
        _, client = engine.load_checkpoint(args.ckpt)
        start = client["step"] + 1
    for step in range(start, args.steps):
        loss = train_steps(engine, step, 1)[0]
        engine.save_checkpoint(args.ckpt, client_state={"step": step})
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps({"started_at": start, "step": step, "loss": loss, "world": world}) + "\\n")
        if attempt == 0 and step == args.die_after and rank == args.die_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)
    '''
)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("elastic")
    (directory / "train.py").write_text(TRAIN)
    return directory


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    """Losses of the same 2-rank training with no failure (single process, the parity oracle)."""
    from tests.parity import oracle

    return oracle(STEPS, 4)[0]


def read_steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def assert_resumed(out: Path, uninterrupted: list[float], died_after: int) -> None:
    """Every step ran once with the uninterrupted run's loss; the steps after the failure ran in processes
    started again, which resumed from the checkpoint of the step before."""
    lines = read_steps(out)
    assert [line["step"] for line in lines] == list(range(STEPS)), lines
    assert [line["loss"] for line in lines] == pytest.approx(uninterrupted, rel=1e-5)
    assert [line["started_at"] for line in lines] == [0] * (died_after + 1) + [died_after + 1] * (STEPS - died_after - 1)


def test_one_node_restarts_its_ranks_and_resumes_from_the_checkpoint(job: Path, uninterrupted: list[float]) -> None:
    out, ckpt = job / "local.jsonl", job / "ckpt-local"
    cmd = launcher_cmd(["--num_gpus", "2", "--elastic_training", "--max_restarts", "2", "train.py",
                        "--ckpt", str(ckpt), "--out", str(out), "--die_after", "2"])
    result = subprocess.run(cmd, cwd=job, env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_resumed(out, uninterrupted, died_after=2)


def test_without_restarts_left_the_failure_ends_the_job(job: Path) -> None:
    out, ckpt = job / "norestart.jsonl", job / "ckpt-norestart"
    cmd = launcher_cmd(["--num_gpus", "2", "--elastic_training", "--max_restarts", "0", "train.py",
                        "--ckpt", str(ckpt), "--out", str(out), "--die_after", "1"])
    result = subprocess.run(cmd, cwd=job, env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode != 0
    assert "rank 1 (local rank 1" in result.stderr and "signal 9 (SIGKILL)" in result.stderr, result.stderr[-4000:]
    assert [line["step"] for line in read_steps(out)] == [0, 1]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with namespace_hosts(tmp_path_factory, "multi-node elastic tests") as made:
        yield made


def elastic_cmd(hosts: Hosts, job: Path, name: str, *script_args: str) -> tuple[list[str], dict[str, str]]:
    args, env = ssh_args(hosts, "ssh")
    cmd = launcher_cmd([*args, "--save_pid", "--hostfile", str(hosts.hostfile(job / f"hostfile-{name}", slots=1)),
                        "--elastic_training", "--min_nodes", "2", "--max_nodes", "2", "--max_restarts", "2",
                        "train.py", "--ckpt", str(job / f"ckpt-{name}"), "--out", str(job / f"{name}.jsonl"),
                        *script_args])
    return hosts.in_ns(0, cmd), env


def test_two_nodes_restart_after_a_rank_dies_and_resume(hosts: Hosts, job: Path, uninterrupted: list[float]) -> None:
    cmd, env = elastic_cmd(hosts, job, "rank-dies", "--die_after", "2")  # rank 1 is the one on the second host
    result = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=2 * RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_resumed(job / "rank-dies.jsonl", uninterrupted, died_after=2)
    assert all(line["world"] == 2 for line in read_steps(job / "rank-dies.jsonl"))


def test_a_lost_node_rejoins_and_training_resumes(hosts: Hosts, job: Path, uninterrupted: list[float]) -> None:
    cmd, env = elastic_cmd(hosts, job, "node-lost", "--step_sleep", "1.0")
    proc = subprocess.Popen(cmd, cwd=job, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = Path(f"/tmp/{proc.pid}.shardwise")  # --save_pid; `ip netns exec` execs: the launcher's pid
    out = job / "node-lost.jsonl"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (out.exists() and len(read_steps(out)) >= 2):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        os.kill(saved_pids(pid_file)[f"agent {hosts.addrs[1]}"], signal.SIGKILL)
        _, err = proc.communicate(timeout=2 * RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in saved_pids(pid_file).values():
            kill_if_alive(pid)
        pid_file.unlink(missing_ok=True)
    assert proc.returncode == 0, err[-4000:]
    assert f"node 1 ({hosts.addrs[1]}) was lost; starting its agent again to rejoin" in err, err[-4000:]
    lines = read_steps(out)  # a step cut short by the loss of the node is done again: the last line counts
    by_step = {line["step"]: line for line in lines}
    assert sorted(by_step) == list(range(STEPS)), lines
    assert [by_step[s]["loss"] for s in range(STEPS)] == pytest.approx(uninterrupted, rel=1e-5)
    assert by_step[STEPS - 1]["started_at"] >= 2, lines  # the last steps ran in processes that resumed


def saved_pids(pid_file: Path) -> dict[str, int]:
    """``role host -> pid`` from the --save_pid file; the agent started again for a rejoin comes last."""
    lines = [line.split() for line in pid_file.read_text().splitlines()] if pid_file.exists() else []
    return {f"{role} {host}": int(pid) for role, host, pid in lines}
