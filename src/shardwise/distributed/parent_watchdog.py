"""Parent-death watchdog: a rank whose launcher or node agent is gone stops itself (stdlib only).

[Note: orphaned ranks] The elastic agent starts each worker in its own session, so when the agent (or the
``shardwise`` launcher that runs it) is killed with SIGKILL — the OOM killer, a preempted pod — nothing
signals the workers: they keep training, holding devices and writing checkpoints. Each rank therefore
watches its parent: when the parent pid changes (the rank was re-parented to init or a subreaper), the rank
sends itself SIGTERM (a script's own preemption handler still runs) and, if it is still alive
:data:`GRACE_S` later, SIGKILL. Polling ``getppid`` works for every launcher (elastic agent, mpirun/orted,
slurmstepd) and, unlike ``PR_SET_PDEATHSIG``, does not fire when merely the thread that forked us exits.

The watchdog runs in every rank that a launcher started: ``bootstrap.py`` starts it before the user's
script, and ``init_distributed`` starts it for scripts started by plain ``torchrun``/``mpirun``/``srun``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

POLL_S = 0.5
GRACE_S = 3.0
AGENT_PID_VAR = "SHARDWISE_AGENT_PID"  # set by the shardwise node agent: the parent every rank must have
OPT_OUT_VAR = "SHARDWISE_WATCH_PARENT"  # "0" turns the watchdog off
# Any of these means a launcher started this process (and will not outlive it on purpose).
LAUNCHER_VARS = (AGENT_PID_VAR, "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                 "SLURM_STEP_ID")

_lock = threading.Lock()
_watching: int | None = None


def launched_by_agent(environ: Mapping[str, str]) -> bool:
    """Whether a launcher started this process, so that its parent dying means the job is over."""
    return environ.get(OPT_OUT_VAR, "1") != "0" and any(environ.get(v) for v in LAUNCHER_VARS)


def start_parent_watchdog(environ: Mapping[str, str] | None = None) -> bool:
    """Start (once per process) the thread that stops this rank when its parent dies; return whether it runs.

    Does nothing for a script started by hand (no launcher variables). Idempotent: ``bootstrap`` and
    ``init_distributed`` may both call it.
    """
    global _watching
    environ = os.environ if environ is None else environ
    if not launched_by_agent(environ):
        return False
    with _lock:
        if _watching == os.getpid():
            return True
        parent = _expected_parent(environ)
        threading.Thread(target=_watch, args=(parent,), name="shardwise-parent-watchdog", daemon=True).start()
        _watching = os.getpid()
    return True


def _expected_parent(environ: Mapping[str, str]) -> int:
    agent = environ.get(AGENT_PID_VAR, "")
    if agent.isdigit() and int(agent) != os.getpid():
        return int(agent)  # the agent may already be gone: then the first poll fires
    return os.getppid()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _stop_self(parent)


def _stop_self(parent: int) -> None:
    rank = os.environ.get("RANK", "?")
    sys.stderr.write(
        f"shardwise: rank {rank} (pid {os.getpid()}): its launcher process {parent} is gone; "
        "stopping this rank so that it does not run on orphaned.\n"
    )
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)  # the script's SIGTERM handler (if any) had its chance
    os.kill(os.getpid(), signal.SIGKILL)
