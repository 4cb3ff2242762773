"""``shardwise k8s --kind trainjob``: a Kubeflow Trainer v2 ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``).

The job names a training runtime (``--runtime``, by default the ``torch-distributed`` ClusterTrainingRuntime
Kubeflow Trainer installs) and overrides its trainer: image, command, env, ``numNodes`` (``--workers``) pods of
``numProcPerNode`` (``--gpus-per-worker``, or one CPU rank) with the GPUs as ``resourcesPerNode``. The runtime's
torch plugin gives every node's container (named ``node``) ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK`` (the pod's Job completion index) and ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (node 0's);
the ``shardwise`` launcher in each pod reads them (``planning.as_pod_of_job``), as under a PyTorchJob.

Shared memory and ``--pvc`` mounts go in through ``runtimePatches`` (Kubeflow Trainer 2.2 and later; 2.0 and
2.1 called it ``podTemplateOverrides``). Every node runs the same command, so TensorBoard, when asked for,
starts only where ``PET_NODE_RANK`` is 0. Restarts are the runtime's JobSet failure policy, not the job's.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardwise.launcher import k8s_pod

API_VERSION = "trainer.kubeflow.org/v1alpha1"
DEFAULT_RUNTIME = "torch-distributed"
NODE = "node"  # the trainer's replicated job and container in the torch runtimes
PATCH_MANAGER = "shardwise"  # who owns our runtimePatches entry
# Set by the runtime's torch plugin; the Trainer refuses a TrainJob whose env sets them.
PET_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def _trainer(args: argparse.Namespace, script: list[str]) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "image": args.image,
        "command": k8s_pod.command(script, args.tensorboard_logdir, when='[ "$PET_NODE_RANK" = 0 ]'),
        "env": k8s_pod.env(args.env, args.tensorboard_logdir, reserved=PET_VARS, owner="the Trainer's torch runtime"),
        "numNodes": args.workers,
        "numProcPerNode": max(args.gpus_per_worker, 1),
    }
    if args.gpus_per_worker:
        trainer["resourcesPerNode"] = k8s_pod.gpu_resources(args.gpus_per_worker)
    return trainer


def _mounts_patch(pvcs: list[str]) -> dict[str, Any]:
    volumes, mounts = k8s_pod.volumes(pvcs)
    pod = {"volumes": volumes, "containers": [{"name": NODE, "volumeMounts": mounts}]}
    job = {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}}}


def build(args: argparse.Namespace, script: list[str], metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": "TrainJob", "metadata": metadata,
        "spec": {"runtimeRef": {"name": args.runtime or DEFAULT_RUNTIME, "apiGroup": "trainer.kubeflow.org",
                                "kind": "ClusterTrainingRuntime"},
                 "trainer": _trainer(args, script),
                 "runtimePatches": [_mounts_patch(args.pvc)]},
    }
