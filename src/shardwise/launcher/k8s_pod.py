"""What every ``shardwise k8s`` pod gets, whichever Kubeflow API runs it: the command (``shardwise script args``,
with TensorBoard beside rank 0's when asked), environment, shared memory and PersistentVolumeClaim mounts.
Pure: builds dicts, reads no cluster."""

from __future__ import annotations

import re
import shlex
from typing import Any

TENSORBOARD_PORT = 6006
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class K8sError(ValueError):
    """A ``shardwise k8s`` option is wrong; the message says which and how to fix it."""


def command(script: list[str], tensorboard_logdir: str | None, when: str | None = None) -> list[str]:
    """``shardwise script args``; with a log dir, TensorBoard serves it for as long as training runs, started
    where the shell test `when` holds (every pod that runs this command, without one)."""
    run = ["shardwise", *script]
    if not tensorboard_logdir:
        return run
    serve = shlex.join(["tensorboard", "--logdir", tensorboard_logdir, "--port", str(TENSORBOARD_PORT), "--bind_all"])
    start = f"if {when}; then {serve} & fi; " if when else f"{serve} & "
    return ["sh", "-c", f"{start}exec {shlex.join(run)}"]


def volumes(pvcs: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts): /dev/shm in memory, and each ``--pvc NAME:/mount``."""
    pod: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # NCCL/dataloaders need shm
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for index, pvc in enumerate(pvcs):
        claim, sep, path = pvc.partition(":")
        if not sep or not claim or not path.startswith("/"):
            raise K8sError(f"--pvc {pvc!r}: expected NAME:/mount/path, e.g. data:/mnt/data.")
        pod.append({"name": f"pvc-{index}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"pvc-{index}", "mountPath": path})
    return pod, mounts


def env(pairs: list[str], logdir: str | None, reserved: tuple[str, ...] = (), owner: str = "") -> list[dict[str, str]]:
    """PYTHONUNBUFFERED, TENSORBOARD_LOGDIR and each ``--env KEY=VALUE``; `reserved` names are `owner`'s."""
    out = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    out += [{"name": "TENSORBOARD_LOGDIR", "value": logdir}] if logdir else []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise K8sError(f"--env {pair!r}: expected KEY=VALUE with a valid variable name.")
        if key in reserved:
            raise K8sError(f"--env {pair!r}: {key} is set by {owner} in every pod; drop it (the launcher reads it).")
        out.append({"name": key, "value": value})
    return out


def gpu_resources(gpus: int) -> dict[str, dict[str, int]]:
    limit = {"nvidia.com/gpu": gpus} if gpus else {}
    return {"limits": dict(limit), "requests": dict(limit)}
