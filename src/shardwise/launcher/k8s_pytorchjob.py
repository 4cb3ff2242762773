"""``shardwise k8s`` (the default ``--kind pytorchjob``): a Kubeflow Training Operator v1 ``PyTorchJob``.

One ``Master`` pod and ``--workers - 1`` ``Worker`` pods, each running ``shardwise script args`` in a container
named ``pytorch`` (the name the operator looks for). The operator injects ``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE`` and ``PET_NNODES``/``PET_NODE_RANK``/``PET_NPROC_PER_NODE``; the ``shardwise``
launcher in each pod reads the ``PET_*`` variables (``planning.as_pod_of_job``) and starts
``--gpus-per-worker`` ranks there. TensorBoard, when asked for, runs in the master's container.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardwise.launcher import k8s_pod

MASTER_PORT = 23456  # the operator's default; the port is named "pytorchjob-port"
DEFAULT_RESTARTS = 3


def _container(args: argparse.Namespace, script: list[str], master: bool) -> dict[str, Any]:
    logdir = args.tensorboard_logdir if master else None
    ports = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT, "protocol": "TCP"}]
    if logdir:
        ports.append({"name": "tensorboard", "containerPort": k8s_pod.TENSORBOARD_PORT, "protocol": "TCP"})
    _, mounts = k8s_pod.volumes(args.pvc)
    return {"name": "pytorch", "image": args.image, "imagePullPolicy": "IfNotPresent",
            "command": k8s_pod.command(script, logdir), "env": k8s_pod.env(args.env, args.tensorboard_logdir),
            "ports": ports, "volumeMounts": mounts, "resources": k8s_pod.gpu_resources(args.gpus_per_worker)}


def _replica(args: argparse.Namespace, script: list[str], count: int, master: bool) -> dict[str, Any]:
    volumes, _ = k8s_pod.volumes(args.pvc)
    labels = {"app.kubernetes.io/name": args.name, "app.kubernetes.io/managed-by": "shardwise"}
    return {"replicas": count, "restartPolicy": "OnFailure",
            "template": {"metadata": {"labels": labels},
                         "spec": {"containers": [_container(args, script, master)], "volumes": volumes}}}


def build(args: argparse.Namespace, script: list[str], metadata: dict[str, Any]) -> dict[str, Any]:
    replicas = {"Master": _replica(args, script, 1, master=True)}
    if args.workers > 1:
        replicas["Worker"] = _replica(args, script, args.workers - 1, master=False)
    restarts = DEFAULT_RESTARTS if args.max_restarts is None else args.max_restarts
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata,
        "spec": {"nprocPerNode": str(max(args.gpus_per_worker, 1)),
                 "runPolicy": {"backoffLimit": restarts, "cleanPodPolicy": "Running"},
                 "pytorchReplicaSpecs": replicas},
    }
