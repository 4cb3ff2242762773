"""``shardwise k8s``: write a Kubeflow Training Operator ``PyTorchJob`` manifest (pure: no cluster access).

The job has one ``Master`` pod and ``--workers - 1`` ``Worker`` pods, each running ``shardwise script args``
in a container named ``pytorch`` (the name the operator looks for). The operator injects ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``PET_NNODES``/``PET_NODE_RANK``/``PET_NPROC_PER_NODE``; the
``shardwise`` launcher in each pod reads the ``PET_*`` variables (``planning.as_pod_of_job``) and starts
``--gpus-per-worker`` ranks there, so ranks and world size come from the operator. Submit and follow with::

    shardwise k8s --name llm --image registry/img:tag --workers 2 --gpus-per-worker 8 \\
        --pvc data:/mnt/data --tensorboard-logdir /mnt/data/tb -- train.py --deepspeed_config ds.json > job.yaml
    kubectl apply -f job.yaml
    kubectl get pytorchjob llm -w                     # status; pods are llm-master-0, llm-worker-0, ...
    kubectl logs -f llm-master-0                      # rank 0's output
    kubectl port-forward pod/llm-master-0 6006:6006   # TensorBoard at http://localhost:6006
    kubectl delete pytorchjob llm
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from typing import Any

MASTER_PORT = 23456  # the operator's default; the port is named "pytorchjob-port"
TENSORBOARD_PORT = 6006
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")  # DNS label; pods get "-master-0" etc.


class K8sError(ValueError):
    """A ``shardwise k8s`` option is wrong; the message says which and how to fix it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise k8s", description=__doc__.split("\n\n")[0],
                                     usage="shardwise k8s --name N --image IMG [options] -- script.py [args]")
    add = parser.add_argument
    add("--name", required=True, help="PyTorchJob name (lower-case DNS label)")
    add("--image", required=True, help="container image with shardwise and the training code")
    add("--workers", type=int, default=1, help="pods in all, the master included (default 1)")
    add("--gpus-per-worker", type=int, default=1, help="ranks (and nvidia.com/gpu) per pod; 0: one CPU rank")
    add("--pvc", action="append", default=[], metavar="NAME:/MOUNT", help="mount a PersistentVolumeClaim (repeatable)")
    add("--tensorboard-logdir", default=None, metavar="DIR", help="serve DIR with TensorBoard on the master, port 6006")
    add("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment for every pod")
    add("--namespace", default=None, help="Kubernetes namespace")
    add("--max-restarts", type=int, default=3, help="runPolicy.backoffLimit: pod restarts before the job fails")
    add("--format", choices=("yaml", "json"), default="yaml")
    add("command", nargs=argparse.REMAINDER, help="-- script.py [args]: what every pod runs under shardwise")
    return parser


def _check(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise K8sError("no script given; put it after '--': shardwise k8s --name N --image IMG -- train.py [args].")
    if not _NAME_RE.match(args.name):
        raise K8sError(f"--name {args.name!r}: must be a lower-case DNS label (a-z, 0-9, '-'; at most 40 characters).")
    if args.workers < 1:
        raise K8sError(f"--workers must be at least 1 (the master pod); got {args.workers}.")
    if args.gpus_per_worker < 0:
        raise K8sError(f"--gpus-per-worker must be 0 (CPU) or more; got {args.gpus_per_worker}.")
    return command


def _volumes(pvcs: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # NCCL/dataloaders need shm
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for index, pvc in enumerate(pvcs):
        claim, sep, path = pvc.partition(":")
        if not sep or not claim or not path.startswith("/"):
            raise K8sError(f"--pvc {pvc!r}: expected NAME:/mount/path, e.g. data:/mnt/data.")
        volumes.append({"name": f"pvc-{index}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"pvc-{index}", "mountPath": path})
    return volumes, mounts


def _env(pairs: list[str], logdir: str | None) -> list[dict[str, str]]:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": "TENSORBOARD_LOGDIR", "value": logdir}] if logdir else []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise K8sError(f"--env {pair!r}: expected KEY=VALUE with a valid variable name.")
        env.append({"name": key, "value": value})
    return env


def _container(args: argparse.Namespace, command: list[str], master: bool) -> dict[str, Any]:
    run = ["shardwise", *command]
    ports = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT, "protocol": "TCP"}]
    if master and args.tensorboard_logdir:  # TensorBoard lives as long as training, in the master's container
        serve = shlex.join(["tensorboard", "--logdir", args.tensorboard_logdir, "--port", str(TENSORBOARD_PORT), "--bind_all"])
        run = ["sh", "-c", f"{serve} & exec {shlex.join(run)}"]
        ports.append({"name": "tensorboard", "containerPort": TENSORBOARD_PORT, "protocol": "TCP"})
    volumes, mounts = _volumes(args.pvc)
    gpus = {"nvidia.com/gpu": args.gpus_per_worker} if args.gpus_per_worker else {}
    return {"name": "pytorch", "image": args.image, "imagePullPolicy": "IfNotPresent", "command": run,
            "env": _env(args.env, args.tensorboard_logdir), "ports": ports, "volumeMounts": mounts,
            "resources": {"limits": dict(gpus), "requests": dict(gpus)}}


def _replica(args: argparse.Namespace, command: list[str], count: int, master: bool) -> dict[str, Any]:
    volumes, _ = _volumes(args.pvc)
    labels = {"app.kubernetes.io/name": args.name, "app.kubernetes.io/managed-by": "shardwise"}
    return {"replicas": count, "restartPolicy": "OnFailure",
            "template": {"metadata": {"labels": labels},
                         "spec": {"containers": [_container(args, command, master)], "volumes": volumes}}}


def build_manifest(args: argparse.Namespace) -> dict[str, Any]:
    command = _check(args)
    replicas = {"Master": _replica(args, command, 1, master=True)}
    if args.workers > 1:
        replicas["Worker"] = _replica(args, command, args.workers - 1, master=False)
    metadata: dict[str, Any] = {"name": args.name, "labels": {"app.kubernetes.io/managed-by": "shardwise"}}
    if args.namespace:
        metadata["namespace"] = args.namespace
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata,
        "spec": {"nprocPerNode": str(max(args.gpus_per_worker, 1)),
                 "runPolicy": {"backoffLimit": args.max_restarts, "cleanPodPolicy": "Running"},
                 "pytorchReplicaSpecs": replicas},
    }


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML; every string is a JSON string (valid YAML), so nothing is mis-typed."""
    pad = " " * indent
    if isinstance(value, dict):
        return "".join(f"{pad}{_key(key)}:{_after_key(item, indent)}" for key, item in value.items()) if value else f"{pad}{{}}\n"
    if isinstance(value, list):
        return "".join(f"{pad}-{_after_dash(item, indent)}" for item in value) if value else f"{pad}[]\n"
    return f"{pad}{json.dumps(value)}\n"


def _key(key: str) -> str:
    return key if re.match(r"^[A-Za-z][A-Za-z0-9_./-]*$", key) else json.dumps(key)


def _after_key(item: Any, indent: int) -> str:
    if isinstance(item, (dict, list)) and item:
        return "\n" + to_yaml(item, indent + 2)
    return " " + to_yaml(item).lstrip()


def _after_dash(item: Any, indent: int) -> str:
    if isinstance(item, dict) and item:
        return " " + to_yaml(item, indent + 2)[indent + 2:]
    return _after_key(item, indent)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        manifest = build_manifest(args)
    except K8sError as error:
        print(f"shardwise k8s: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(manifest) if args.format == "yaml" else json.dumps(manifest, indent=2) + "\n")
    return 0
