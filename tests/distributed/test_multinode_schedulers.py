"""Jobs whose ranks a scheduler starts: ``shardwise --launcher openmpi`` (Debian's openmpi-bin), and workers
started with exactly the variables ``srun`` gives its tasks (no SLURM here: the env is the interface)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardwise.distributed.env import free_port
from tests.distributed.test_multinode import RUN_TIMEOUT_S, TRAIN, _kill, child_env, launcher_cmd, run_ok, wait_all_gone

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_openmpi_runs_the_same_job(job: Path) -> None:
    from tests.parity import oracle

    out = job / "mpi.json"
    port = str(free_port())
    run_ok(launcher_cmd(["--launcher", "openmpi", "--num_gpus", "2", "--master_port", port, "train.py", "--out", str(out),
                         "--label", "a b"]), job, child_env())
    got = json.loads(out.read_text())
    assert (got["world"], got["label"]) == (2, "a b")
    assert got["losses"] == pytest.approx(oracle(4, 4)[0], rel=1e-5)


def srun_env(procid: int, tasks: int, port: int) -> dict[str, str]:
    """An srun task's variables (one node, ``tasks`` tasks); MASTER_PORT as sbatch scripts export it."""
    return {
        "SLURM_JOB_ID": "777", "SLURM_JOBID": "777", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid), "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        "SLURM_TASKS_PER_NODE": str(tasks), "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost", "SLURMD_NODENAME": "localhost", "SLURM_GTIDS": ",".join(map(str, range(tasks))),
        "SLURM_CPUS_ON_NODE": "2", "MASTER_PORT": str(port),
    }


def test_srun_tasks_find_their_ranks(job: Path) -> None:
    from tests.parity import oracle

    out, port = job / "slurm.json", free_port()
    tasks = [subprocess.Popen([sys.executable, "train.py", "--out", str(out)], cwd=job, env={**child_env(), **srun_env(i, 2, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [task.communicate(timeout=RUN_TIMEOUT_S)[0] for task in tasks]
    assert all(t.returncode == 0 for t in tasks), "\n".join(o[-3000:] for o in outputs)
    got = json.loads(out.read_text())
    assert got["world"] == 2
    assert got["losses"] == pytest.approx(oracle(4, 4)[0], rel=1e-5)


ORPHAN = textwrap.dedent(
    '''
    """Started by plain torchrun (no shardwise bootstrap): init_distributed must start the watchdog."""
    import os, sys, time
    import shardwise
    shardwise.init_distributed(dist_backend="gloo", verbose=False)
    with open(sys.argv[1] + f".rank{os.environ['RANK']}", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    time.sleep(600)
    '''
)


def test_ranks_of_a_sigkilled_torchrun_agent_stop_themselves(job: Path) -> None:
    (job / "orphan.py").write_text(ORPHAN)
    marker = job / "pid"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              f"--master-port={free_port()}", "orphan.py", str(marker)], cwd=job, env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = [Path(f"{marker}.rank{r}") for r in range(2)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all(f.exists() and f.read_text() for f in files):
        assert agent.poll() is None and time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    pids = [int(f.read_text().split()[0]) for f in files]
    agent.kill()  # SIGKILL: the agent cannot stop its workers
    agent.wait()
    left = wait_all_gone({f"rank {r}": pid for r, pid in enumerate(pids)}, within=10)
    for pid in pids:  # leave nothing behind, whatever the outcome
        _kill(pid)
    assert left == [], f"ranks of a SIGKILLed torchrun agent still ran 10 s later: {left}"
