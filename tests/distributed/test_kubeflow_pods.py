"""Kubeflow pods find the job's world and their own rank from what the operator gives them, or refuse loudly.

Every pod of a 2-node x 1-process job runs as a real process with exactly the variables its operator sets: a
Trainer v2 TrainJob's torch runtime sets only ``PET_NNODES``/``PET_NPROC_PER_NODE``/``PET_NODE_RANK``/
``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (kubeflow/trainer, pkg/runtime/framework/plugins/torch); a PyTorchJob
of a Training Operator older than ``nprocPerNode`` sets only ``MASTER_ADDR``/``MASTER_PORT``, ``WORLD_SIZE`` (the
pods) and ``RANK`` (the pod's index). Each pod's script joins with gloo and all-reduces: a pod that trained
alone at world size 1 writes world 1 and a sum of 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardwise.distributed.env import DistEnv, EnvError, PodOfJob, discover, free_port, pod_of_job
from shardwise.launcher import k8s
from tests.distributed.test_k8s_trainjob import torch_runtime_env
from tests.distributed.test_multinode import REPO, child_env
from tests.rank_zygote import routing

pytestmark = [pytest.mark.timeout(120)]

BIN = Path(sys.executable).parent
SCRIPT = textwrap.dedent('''
    import argparse, json
    import torch
    import deepspeed
    from deepspeed import comm

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    before = [comm.get_rank(), comm.get_world_size(), comm.get_local_rank()]
    deepspeed.init_distributed(dist_backend="gloo")
    total = torch.ones(1)
    comm.all_reduce(total)
    with open(args.out, "w") as f:
        json.dump({"before_init": before, "rank": comm.get_rank(), "world": comm.get_world_size(),
                   "local_rank": comm.get_local_rank(), "sum": total.item()}, f)
''')


def trainjob_env(node: int, port: int, nproc: str = "1") -> dict[str, str]:
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": str(port)}


def old_operator_env(pod: int, port: int) -> dict[str, str]:
    """pod 0 is ``<job>-master-0``, pod 1 ``<job>-worker-0`` (MASTER_ADDR stands for the master's service)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(pod),
            "PYTHONUNBUFFERED": "0"}


def run_pods(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[dict]:
    """Every pod's command at once as a local process with the operator's variables (and nothing of ours)."""
    base = {**child_env(), **routing()}  # the ranks the launcher starts fork from tests/rank_zygote.py
    base["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "compat" / "deepspeed"), str(REPO)])
    base.pop("PYTHONUNBUFFERED", None)
    pods = [subprocess.Popen(command, cwd=cwd, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for command, env in zip(commands, envs, strict=True)]
    outputs = []
    for pod in pods:
        try:
            outputs.append(pod.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:  # a pod waiting for a peer that trained alone
            pod.kill()
            outputs.append(pod.communicate()[0] + "\n(killed after 60 s)")
    assert all(pod.returncode == 0 for pod in pods), "\n".join(o[-3000:] for o in outputs)
    return [json.loads((cwd / f"pod{i}.json").read_text()) for i in range(len(pods))]


def assert_world_of_two(results: list[dict]) -> None:
    for pod, got in enumerate(results):
        assert (got["rank"], got["world"], got["local_rank"], got["sum"]) == (pod, 2, 0, 2.0), (pod, got)
        assert got["before_init"] == [pod, 2, 0], (pod, got)  # deepspeed.comm answers before init as after


@pytest.mark.parametrize("how", ["trainjob command", "python"])
def test_trainjob_pods_of_one_process_each_train_at_world_two(tmp_path: Path, how: str) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    args = k8s.build_parser().parse_args(["--name", "job", "--image", "img", "--kind", "trainjob", "--workers", "2",
                                          "--gpus-per-worker", "0", "--", "train.py"])
    job = k8s.build_manifest(args)
    trainer, port = job["spec"]["trainer"], free_port()
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["command"]) == (2, 1, ["shardwise", "train.py"])
    command = [str(BIN / "shardwise"), "train.py"] if how == "trainjob command" else [sys.executable, "train.py"]
    envs = [{e["name"]: e["value"] for e in trainer["env"]} | torch_runtime_env(job, node, port) for node in (0, 1)]
    assert all(set(env) - {"PYTHONUNBUFFERED"} == {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK",
                                                   "PET_MASTER_ADDR", "PET_MASTER_PORT"} for env in envs)
    assert_world_of_two(run_pods([[*command, "--out", f"pod{node}.json"] for node in (0, 1)], envs, tmp_path))


@pytest.mark.parametrize("launcher", ["python", "shardwise", "deepspeed"])
def test_old_operator_pytorchjob_pods_train_at_world_two(tmp_path: Path, launcher: str) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    start = [sys.executable] if launcher == "python" else [str(BIN / launcher)]
    port = free_port()
    results = run_pods([[*start, "train.py", "--out", f"pod{pod}.json"] for pod in (0, 1)],
                       [old_operator_env(pod, port) for pod in (0, 1)], tmp_path)
    assert_world_of_two(results)


def test_trainjob_pod_variables_give_rank_and_world() -> None:
    assert discover(environ=trainjob_env(1, 29400)) == DistEnv(1, 2, 0, 1, "job-node-0-0.job", 29400, "kubeflow")
    assert pod_of_job(trainjob_env(1, 29400, "auto")) == PodOfJob(1 + 1, 1, None, "job-node-0-0.job", 29400,
                                                                  "PET_NNODES=2, PET_NPROC_PER_NODE=auto")
    one_pod = {**trainjob_env(0, 29400, "auto"), "PET_NNODES": "1"}  # one pod: plain python is the whole job
    assert discover(environ=one_pod).world_size == 1


@pytest.mark.parametrize("nproc", ["2", "auto", "gpu"])
def test_trainjob_pod_of_several_processes_started_as_plain_python_is_refused(nproc: str) -> None:
    with pytest.raises(EnvError, match=rf"TrainJob pod \(PET_NNODES=2, PET_NPROC_PER_NODE={nproc}, PET_NODE_RANK=1\) "
                                       r"started as plain `python`.*`shardwise script.py"):
        discover(environ=trainjob_env(1, 29400, nproc))


@pytest.mark.parametrize(("environ", "message"), [
    ({"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "1", "PET_RDZV_ENDPOINT": "job-master-0:23456"},
     "(an elastic job: PET_NNODES is min:max), but PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT are not set"),
    ({**trainjob_env(2, 29400)}, "PET_NODE_RANK (2) must be in [0, PET_NNODES (2))"),
])
def test_incoherent_pod_variables_are_errors(environ: dict[str, str], message: str) -> None:
    for read in (lambda: discover(environ=environ), lambda: pod_of_job(environ)):
        with pytest.raises(EnvError) as error:
            read()
        assert message in str(error.value)


def test_old_operator_pod_is_a_node_for_the_launcher_but_a_launched_rank_is_not() -> None:
    pod = old_operator_env(1, 23456)
    assert pod_of_job(pod) == PodOfJob(2, 1, 1, "127.0.0.1", 23456, "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, no PET_*")
    assert discover(environ=pod) == DistEnv(1, 2, 0, 1, "127.0.0.1", 23456, "torch")  # plain python: LOCAL_RANK 0
    assert pod_of_job({**pod, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}) is None  # a process torchrun started
