"""Which environment variables travel from the launcher to every node (pure: reads files and a dict).

A remote shell starts with a bare environment, so the launcher carries, in this order (later wins):

1. variables whose names start with :data:`CARRIED_PREFIXES` (``NCCL_*``, ``PYTHON*`` such as
   ``PYTHONPATH``, ``GLOO_*``/``TORCH_*`` settings, ``UCX_*``, ``OMP_NUM_THREADS``, ``SHARDWISE_RANK_PYTHON`` ...);
2. the active virtual environment (``VIRTUAL_ENV``; its ``bin`` goes first on the remote ``PATH``);
3. the lines of an env file: ``~/.deepspeed_env``, ``~/.shardwise_env``, then the same names in the
   current directory (or the one file named by ``SHARDWISE_ENV_FILE`` / ``DS_ENV_FILE``). A line is
   ``KEY=VALUE`` (sets it) or a bare ``KEY`` (carries this machine's value); ``#`` starts a comment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

CARRIED_PREFIXES = ("NCCL_", "PYTHON", "GLOO_", "TORCH_", "UCX_", "FI_", "MLFLOW", "OMP_NUM_THREADS", "HF_",
                    "SHARDWISE_RANK_PYTHON")  # a rank wrapper set for the job (static_agent.py) applies on every node
# Set per node or per rank by the agent; carrying the launcher's value would be wrong.
NEVER_CARRIED = ("PYTHONHOME", "PYTHONSTARTUP", "TORCHELASTIC_", "TORCH_NPROC_PER_NODE")
ENV_FILE_NAMES = (".deepspeed_env", ".shardwise_env")
ENV_FILE_OVERRIDES = ("SHARDWISE_ENV_FILE", "DS_ENV_FILE")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvFileError(ValueError):
    """An env file line is malformed; the message quotes it."""


def check_name(name: str, where: str) -> str:
    if not _NAME_RE.match(name):
        raise EnvFileError(f"{where}: {name!r} is not a valid variable name (letters, digits, '_').")
    return name


def parse_env_file(text: str, source: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``KEY=VALUE`` and bare ``KEY`` lines → the variables to set on every node."""
    found: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {number} ({line!r})"
        key, sep, value = line.partition("=")
        key = check_name(key.strip().removeprefix("export "), where)
        if sep:
            found[key] = value.strip()
        elif key in environ:
            found[key] = environ[key]
        else:
            raise EnvFileError(f"{where}: {key} is not set here, so there is no value to carry; "
                               f"write '{key}=<value>' or set it before launching.")
    return found


def env_file_paths(cwd: str, home: str, environ: Mapping[str, str]) -> list[str]:
    """The env files to read, lowest priority first."""
    for override in ENV_FILE_OVERRIDES:
        if environ.get(override):
            return [environ[override]]
    dirs = [home] if os.path.abspath(home) == os.path.abspath(cwd) else [home, cwd]
    return [os.path.join(d, name) for d in dirs for name in ENV_FILE_NAMES]


def _prefixed(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items()
            if k.startswith(CARRIED_PREFIXES) and not k.startswith(NEVER_CARRIED) and _NAME_RE.match(k)}


def carried_env(environ: Mapping[str, str], cwd: str, home: str) -> dict[str, str]:
    """The variables every node gets (``PATH`` only as the venv's ``bin``, see ``runners.remote_command``)."""
    carried = _prefixed(environ)
    if environ.get("VIRTUAL_ENV"):
        carried["VIRTUAL_ENV"] = environ["VIRTUAL_ENV"]
    for path in env_file_paths(cwd, home, environ):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                carried.update(parse_env_file(f.read(), path, environ))
        elif path == environ.get("SHARDWISE_ENV_FILE") or path == environ.get("DS_ENV_FILE"):
            raise EnvFileError(f"env file {path}: no such file (named by the environment).")
    return carried
