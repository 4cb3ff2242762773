"""``shardwise k8s --kind trainjob``: the Kubeflow Trainer v2 TrainJob validates against the CRD's schema
(tests/data, extracted from Kubeflow Trainer v2.3.0 by tools/extract_trainjob_crd_schema.py), reads back from its
YAML, and a simulation that runs every node's command as a local process, with the variables the Trainer's torch
runtime injects, trains to the oracle's losses and starts TensorBoard on node 0 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardwise.distributed.env import free_port
from shardwise.launcher import k8s
from tests.distributed.test_k8s import validate
from tests.distributed.test_multinode import TRAIN, child_env
from tests.rank_zygote import routing

pytestmark = [pytest.mark.timeout(180)]

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "data" / "trainjob_crd_schema.json").read_text())
FULL = ("--workers", "4", "--gpus-per-worker", "8", "--pvc", "data:/mnt/data", "--pvc", "ckpt:/ckpt",
        "--tensorboard-logdir", "/mnt/data/tb", "--env", "A=1", "--namespace", "ml", "--runtime", "torch-cuda")


def trainjob(*extra: str, script: tuple[str, ...] = ("train.py", "--label", "a b")) -> dict[str, Any]:
    args = k8s.build_parser().parse_args(["--name", "tiny", "--image", "reg.example/shardwise:1", "--kind", "trainjob",
                                          *extra, "--", *script])
    return k8s.build_manifest(args)


def node_spec(job: dict[str, Any]) -> dict[str, Any]:
    """The pod spec our runtimePatches entry gives the runtime's `node` job."""
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == "shardwise"
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    return node["template"]["spec"]["template"]["spec"]


def test_validator_catches_what_the_api_server_would() -> None:
    bad = trainjob()
    bad["spec"]["trainer"]["numNodes"] = "2"
    bad["spec"]["trainer"]["gpus"] = 1
    bad["spec"]["runtimeRef"]["name"] = ""
    node_spec(bad)["volumes"].append({"name": "dshm", "emptyDir": {}})
    assert validate(bad, SCHEMA) == [
        "$.spec.runtimeRef.name: length 0 outside [1, 253]",
        "$.spec.trainer.numNodes: not int32",
        "$.spec.trainer.gpus: unknown field",
        "$.spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec."
        "volumes: duplicate key ('dshm',)",
    ]


def test_minimal_trainjob_runs_the_script_under_shardwise_on_one_cpu_rank() -> None:
    job = trainjob("--gpus-per-worker", "0")
    assert validate(job, SCHEMA) == []
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob", "tiny")
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                         "kind": "ClusterTrainingRuntime"}
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == ["shardwise", "train.py", "--label", "a b"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], "resourcesPerNode" in trainer) == (1, 1, False)
    assert trainer["env"] == [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    spec = node_spec(job)
    assert spec["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert spec["containers"] == [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]


def test_full_trainjob_from_its_yaml() -> None:
    job = trainjob(*FULL)
    assert validate(job, SCHEMA) == []
    parsed = yaml.safe_load(k8s.to_yaml(job))
    assert parsed == job
    assert parsed["metadata"]["namespace"] == "ml" and parsed["spec"]["runtimeRef"]["name"] == "torch-cuda"
    trainer = parsed["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}, "requests": {"nvidia.com/gpu": 8}}
    assert trainer["command"] == ["sh", "-c", 'if [ "$PET_NODE_RANK" = 0 ]; then tensorboard --logdir /mnt/data/tb '
                                  "--port 6006 --bind_all & fi; exec shardwise train.py --label 'a b'"]
    assert {"name": "A", "value": "1"} in trainer["env"] and {"name": "TENSORBOARD_LOGDIR", "value": "/mnt/data/tb"} in trainer["env"]
    spec = node_spec(parsed)
    assert {"name": "pvc-1", "persistentVolumeClaim": {"claimName": "ckpt"}} in spec["volumes"]
    assert {"name": "pvc-1", "mountPath": "/ckpt"} in spec["containers"][0]["volumeMounts"]


def test_the_command_line_writes_the_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--name", "tiny", "--image", "img", "--kind", "trainjob", "--workers", "2", "--", "train.py"]
    assert k8s.main(argv) == 0
    assert yaml.safe_load(capsys.readouterr().out) == k8s.build_manifest(k8s.build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--kind", "trainjob", "--max-restarts", "2"], "--max-restarts 2: a TrainJob has no restart count of its own"),
     (["--runtime", "torch-distributed"], "--runtime torch-distributed: only a TrainJob runs on a training runtime"),
     (["--kind", "trainjob", "--env", "PET_NNODES=2"], "--env 'PET_NNODES=2': PET_NNODES is set by the Trainer's torch "
                                                        "runtime in every pod"),
     (["--kind", "trainjob", "--name", "1job"], "--name '1job': must be a lower-case DNS label starting with a letter")],
)
def test_bad_trainjob_options_are_explained(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = [] if "--name" in args else ["--name", "ok"]
    assert k8s.main([*base, "--image", "i", *args, "--", "t.py"]) == 2
    assert message in capsys.readouterr().err


def torch_runtime_env(job: dict[str, Any], node: int, port: int) -> dict[str, str]:
    """What the torch plugin of Kubeflow Trainer injects into node `node`'s container (PET_MASTER_ADDR stands
    for node 0's pod, ``<name>-node-0-0.<name>``, which is this machine here)."""
    trainer = job["spec"]["trainer"]
    return {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": str(node), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}


def test_simulated_trainjob_trains_to_the_oracle(tmp_path: Path) -> None:
    from tests.parity import oracle

    (tmp_path / "train.py").write_text(TRAIN)
    fake_bin, started = tmp_path / "bin", tmp_path / "tensorboard_started"
    fake_bin.mkdir()
    (fake_bin / "tensorboard").write_text(f'#!/bin/sh\necho "$PET_NODE_RANK $*" >> {started}\n')
    (fake_bin / "tensorboard").chmod(0o755)
    out = tmp_path / "losses.json"
    job = trainjob("--workers", "2", "--gpus-per-worker", "2", "--tensorboard-logdir", str(tmp_path / "tb"),
                   script=("train.py", "--out", str(out)))
    assert validate(job, SCHEMA) == []
    trainer, port = job["spec"]["trainer"], free_port()
    path = os.pathsep.join([str(fake_bin), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**child_env(), **routing(), **{e["name"]: e["value"] for e in trainer["env"]}, "PATH": path}
    pods = [subprocess.Popen(trainer["command"], cwd=tmp_path, env={**env, **torch_runtime_env(job, node, port)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for node in range(trainer["numNodes"])]
    outputs = [pod.communicate(timeout=150)[0] for pod in pods]
    assert all(pod.returncode == 0 for pod in pods), "\n".join(o[-3000:] for o in outputs)
    got = json.loads(out.read_text())
    assert got["world"] == 4
    assert got["losses"] == pytest.approx(oracle(4, 8)[0], rel=1e-5)
    assert started.read_text() == f"0 --logdir {tmp_path / 'tb'} --port 6006 --bind_all\n"
