"""Rank/world/master discovery from each launcher's variables (pure: ``discover(environ=...)``).

The environments are the variables those systems set (srun 23.x, Open MPI 4.1, MPICH Hydra, the Kubeflow
training operator v1), trimmed to the ones that matter plus a few distractors.
"""

from __future__ import annotations

import pytest

from shardwise.distributed.env import DistEnv, EnvError, discover, expand_tasks_per_node, first_host


def srun_task(procid: int, nodeid: int, localid: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": "6", "SLURM_NPROCS": "6",
        "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,2",
        "SLURM_TASKS_PER_NODE": "4,2", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_NODELIST": "gpu[07-08]", "SLURMD_NODENAME": f"gpu0{7 + nodeid}", "SLURM_GTIDS": "4,5" if nodeid else "0,1,2,3",
    }


def test_srun_task_on_the_second_node() -> None:
    env = discover(environ=srun_task(procid=5, nodeid=1, localid=1))
    assert env == DistEnv(5, 6, 1, 2, "gpu07", 29500, "slurm")


def test_slurm_batch_script_itself_is_not_a_rank() -> None:
    batch = {k: v for k, v in srun_task(0, 0, 0).items() if "STEP" not in k}
    assert discover(environ=batch).world_size == 1


def test_slurm_master_addr_and_port_win() -> None:
    env = discover(environ={**srun_task(0, 0, 0), "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 1234)


@pytest.mark.parametrize(("text", "first"), [("gpu[03-05,9],cpu1", "gpu03"), ("node7", "node7"), ("a1,b2", "a1"),
                                              ("rack1-n[0012]", "rack1-n0012")])
def test_slurm_nodelist_first_host(text: str, first: str) -> None:
    assert first_host(text) == first


def test_slurm_tasks_per_node_expansion() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_openmpi_single_host_needs_no_master() -> None:
    environ = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "0"}
    assert discover(environ=environ) == DistEnv(1, 2, 1, 2, "127.0.0.1", 29500, "openmpi")


def test_openmpi_on_several_hosts_without_master_is_explained() -> None:
    environ = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(EnvError, match="openmpi: 4 ranks on several hosts, but MASTER_ADDR is not set"):
        discover(environ=environ)


def test_mpich_hydra() -> None:
    environ = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
               "MASTER_ADDR": "n1", "MASTER_PORT": "2000"}
    assert discover(environ=environ) == DistEnv(2, 4, 0, 2, "n1", 2000, "mpich")


def pytorchjob_pod(index: int, replica: str, nproc: int = 1, workers: int = 2) -> dict[str, str]:
    """What the training operator injects into a PyTorchJob pod (master + ``workers``)."""
    rank = index + (1 if replica == "worker" else 0)
    return {
        "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456", "WORLD_SIZE": str((workers + 1) * nproc), "RANK": str(rank),
        "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(rank), "PET_NNODES": str(workers + 1),
        "PYTHONUNBUFFERED": "1",
    }


def test_pytorchjob_pod_with_one_process() -> None:
    assert discover(environ=pytorchjob_pod(1, "worker")) == DistEnv(2, 3, 0, 1, "job-master-0", 23456, "kubeflow")


def test_pytorchjob_pod_with_several_processes_run_as_plain_python_is_explained() -> None:
    with pytest.raises(EnvError, match=r"nprocPerNode=2 .* RANK=1 is the pod's index.*`shardwise script.py"):
        discover(environ=pytorchjob_pod(0, "worker", nproc=2))


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK (4) must be in [0, WORLD_SIZE (4)) (torch variables)"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE: must be an integer; got 'two'."),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK (3) / LOCAL_WORLD_SIZE (2)"),
    ],
)
def test_incoherent_variables_are_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(EnvError) as error:
        discover(environ=environ)
    assert message in str(error.value)


def test_nothing_set_is_a_world_of_one() -> None:
    env = discover(environ={"PATH": "/usr/bin"})
    assert (env.rank, env.world_size, env.master_addr, env.source) == (0, 1, "127.0.0.1", "none")
