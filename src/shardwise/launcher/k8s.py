"""``shardwise k8s``: write a Kubernetes manifest that runs this training under Kubeflow (pure: no cluster access).

``--kind pytorchjob`` (the default) writes a Training Operator v1 ``PyTorchJob`` (``k8s_pytorchjob.py``);
``--kind trainjob`` a Kubeflow Trainer v2 ``TrainJob`` on a torch training runtime (``k8s_trainjob.py``). Either
way every pod runs ``shardwise script args``, which starts ``--gpus-per-worker`` ranks there with the node rank,
node count and master the operator gives the pod. Submit and follow with::

    shardwise k8s --name llm --image registry/img:tag --workers 2 --gpus-per-worker 8 \\
        --pvc data:/mnt/data --tensorboard-logdir /mnt/data/tb -- train.py --deepspeed_config ds.json > job.yaml
    kubectl apply -f job.yaml
    kubectl get pytorchjob llm -w                     # status; pods are llm-master-0, llm-worker-0, ...
    kubectl logs -f llm-master-0                      # rank 0's output
    kubectl port-forward pod/llm-master-0 6006:6006   # TensorBoard at http://localhost:6006
    kubectl delete pytorchjob llm

With ``--kind trainjob``: ``kubectl get trainjob llm -w``; the pods are labelled
``jobset.sigs.k8s.io/jobset-name=llm``, rank 0's also ``batch.kubernetes.io/job-completion-index=0``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from shardwise.launcher import k8s_pytorchjob, k8s_trainjob
from shardwise.launcher.k8s_pod import K8sError

__all__ = ["K8sError", "build_manifest", "build_parser", "main", "to_yaml"]
# An RFC 1035 label (the operators name Services and pods after the job, "-master-0", "-node-0-0" ...).
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
KINDS = {"pytorchjob": k8s_pytorchjob.build, "trainjob": k8s_trainjob.build}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise k8s", usage="shardwise k8s --name N --image IMG [options] -- script.py [args]",
        description="Write a Kubeflow PyTorchJob (Training Operator v1) or TrainJob (Trainer v2) manifest that "
                    "runs the script under shardwise on every pod. Pure: no cluster access.")
    add = parser.add_argument
    add("--name", required=True, help="job name (lower-case DNS label starting with a letter)")
    add("--image", required=True, help="container image with shardwise and the training code")
    add("--kind", choices=sorted(KINDS), default="pytorchjob",
        help="pytorchjob: Training Operator v1 (default); trainjob: Kubeflow Trainer v2 (2.2 or later)")
    add("--runtime", default=None, metavar="NAME",
        help=f"trainjob: the ClusterTrainingRuntime to run on (default {k8s_trainjob.DEFAULT_RUNTIME})")
    add("--workers", type=int, default=1, help="pods (nodes) in all, the master included (default 1)")
    add("--gpus-per-worker", type=int, default=1, help="ranks (and nvidia.com/gpu) per pod; 0: one CPU rank")
    add("--pvc", action="append", default=[], metavar="NAME:/MOUNT", help="mount a PersistentVolumeClaim (repeatable)")
    add("--tensorboard-logdir", default=None, metavar="DIR", help="serve DIR with TensorBoard on rank 0's pod, port 6006")
    add("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment for every pod")
    add("--namespace", default=None, help="Kubernetes namespace")
    add("--max-restarts", type=int, default=None,
        help=f"pytorchjob: runPolicy.backoffLimit, pod restarts before the job fails (default "
             f"{k8s_pytorchjob.DEFAULT_RESTARTS}); a TrainJob's restarts are its runtime's")
    add("--format", choices=("yaml", "json"), default="yaml")
    add("command", nargs=argparse.REMAINDER, help="-- script.py [args]: what every pod runs under shardwise")
    return parser


def _check(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise K8sError("no script given; put it after '--': shardwise k8s --name N --image IMG -- train.py [args].")
    if not _NAME_RE.match(args.name):
        raise K8sError(f"--name {args.name!r}: must be a lower-case DNS label starting with a letter (a-z, 0-9, '-'; "
                       "at most 40 characters).")
    if args.workers < 1:
        raise K8sError(f"--workers must be at least 1 (the master pod); got {args.workers}.")
    if args.gpus_per_worker < 0:
        raise K8sError(f"--gpus-per-worker must be 0 (CPU) or more; got {args.gpus_per_worker}.")
    if args.kind == "trainjob" and args.max_restarts is not None:
        raise K8sError(f"--max-restarts {args.max_restarts}: a TrainJob has no restart count of its own; its runtime's "
                       "JobSet failurePolicy (maxRestarts) decides. Drop the flag, or use --kind pytorchjob.")
    if args.kind == "pytorchjob" and args.runtime is not None:
        raise K8sError(f"--runtime {args.runtime}: only a TrainJob runs on a training runtime; add --kind trainjob.")
    return command


def build_manifest(args: argparse.Namespace) -> dict[str, Any]:
    command = _check(args)
    metadata: dict[str, Any] = {"name": args.name, "labels": {"app.kubernetes.io/managed-by": "shardwise"}}
    if args.namespace:
        metadata["namespace"] = args.namespace
    return KINDS[args.kind](args, command, metadata)


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
