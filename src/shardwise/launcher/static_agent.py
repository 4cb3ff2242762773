"""The agent of a node whose ranks are known in advance: starts them, watches them, stops them all when one fails
(stdlib only).

[Note: own agent] A job with a fixed world whose nodes' slots are all known (one node, or a hostfile's nodes) needs
nothing of torch's elastic agent but what a small supervisor does: give each rank torchrun's environment, start it
in its own session, and when one rank fails stop the rest (the signal, then SIGKILL after :data:`STOP_GRACE_S`).
Torch's agent costs an ``import torch`` (~2 CPU-s) in the launcher of every job and leaves a ``/tmp/torchelastic_*``
folder behind; this one costs neither. Its static rendezvous only computes what is known here: each node's first
global rank is the sum of the slots before it. Elastic jobs, and a Kubeflow pod (which knows only its own slots),
keep torch's agent (``local.run_agent``): they need its rendezvous.

[Note: master port claim] Without an agent store, rank 0's TCPStore binds the master port, seconds after the
launcher checked it (the rank imports torch first). Two launchers on one machine could both pick 29500 in that
gap, and then one job's ranks would join the other job's store: not a crash but a mixed-up job. The agent of
the store's node (node 0) therefore claims its port for the job's life with an abstract Unix socket named after
it (per network namespace, like the port itself; the kernel frees it when the agent dies), or a file lock where
there are no abstract sockets. A claimed or bound port is replaced when the launcher picked it, and refused when
the user asked for it.

[Note: rank python] Each rank is ``python -u -m shardwise.launcher.bootstrap ...`` with the launcher's interpreter.
``SHARDWISE_RANK_PYTHON`` names another command to run in its place (split as a shell would): a wrapper that
runs Python, e.g. ``py-spy record -o rank.svg -- python`` or ``numactl --interleave=all python``. The launcher
signals and waits for the process it started, so a wrapper must pass signals on and exit as Python did. Jobs on
torch's agent (elastic, Kubeflow pods) run it too, as the agent's ``--no-python`` program (``local.torchrun_args``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Union

from shardwise.error_file import host_name
from shardwise.launcher.failures import AgentStopped, Failure, RanksFailed, failure_from_record
from shardwise.launcher.flags import LaunchError
from shardwise.launcher.messages import say
from shardwise.launcher.netutil import free_port, port_is_free

POLL_S = 0.05
STOP_GRACE_S = 30.0  # as torch's agent: a stopped rank may save or clean up before SIGKILL
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's --signals-to-handle default
CLAIM_PREFIX = "shardwise-master-port-"
RANK_PYTHON_VAR = "SHARDWISE_RANK_PYTHON"  # see [Note: rank python]
Claim = Union[socket.socket, IO[str]]  # closing it ends the claim


@dataclass(frozen=True)
class Job:
    """What the agent needs of a ``LocalLaunch`` already routed through ``bootstrap.py``."""

    nproc: int
    argv: tuple[str, ...]  # the command after the interpreter, e.g. ("-m", "shardwise.launcher.bootstrap", ...)
    master_addr: str
    master_port: int
    port_chosen: bool
    run_id: str = "none"
    signals: tuple[str, ...] = DEFAULT_SIGNALS
    node_rank: int = 0
    nnodes: int = 1
    first_rank: int = 0  # this node's first global rank
    world_size: int | None = None  # every node's ranks; None: this node's alone

    @property
    def world(self) -> int:
        return self.nproc if self.world_size is None else self.world_size


def rank_env(job: Job, local_rank: int, port: int, error_file: str) -> dict[str, str]:
    """What torchrun gives a rank of a static job (its workers' environment, variable by variable)."""
    rank = str(job.first_rank + local_rank)
    return {
        "RANK": rank, "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(job.node_rank), "ROLE_RANK": rank,
        "ROLE_NAME": "default", "WORLD_SIZE": str(job.world), "LOCAL_WORLD_SIZE": str(job.nproc),
        "GROUP_WORLD_SIZE": str(job.nnodes), "ROLE_WORLD_SIZE": str(job.world), "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": job.run_id,
        # Rank 0 hosts the store (see [Note: master port claim]); torch's agent would host it itself.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": error_file, "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(job.signals),
    }


def rank_python() -> list[str]:
    """The command that runs each rank's Python (see [Note: rank python]); a bad setting is refused before any
    rank starts."""
    setting = os.environ.get(RANK_PYTHON_VAR, "")
    if not setting.strip():
        return [sys.executable]
    try:
        command = shlex.split(setting)
    except ValueError as error:
        raise LaunchError(f"SHARDWISE_RANK_PYTHON={setting!r} cannot be split into a command line ({error}); quote "
                          "it as a shell would, or unset it.") from None
    if shutil.which(command[0]) is None:
        raise LaunchError(f"SHARDWISE_RANK_PYTHON={setting!r}: {command[0]!r} is not a program on PATH; set it to a "
                          "command that runs Python (e.g. 'py-spy record -o rank.svg -- python'), or unset it.")
    return command


def claim(port: int) -> Claim | None:
    """This job's hold on ``port`` among shardwise launchers here, or None when another launcher holds it."""
    if sys.platform.startswith("linux"):
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            holder.bind(f"\0{CLAIM_PREFIX}{port}")
        except OSError:
            holder.close()
            return None
        return holder
    # No abstract sockets elsewhere: a lock on a file (also freed when the process dies), machine-wide.
    handle = open(os.path.join(tempfile.gettempdir(), f"{CLAIM_PREFIX}{port}.lock"), "a")  # noqa: SIM115 - held
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def claim_master_port(job: Job) -> tuple[int, Claim | None]:
    """The port this job's store will bind, claimed on node 0 (see [Note: master port claim])."""
    if job.node_rank != 0:
        return job.master_port, None  # the store is node 0's
    holder = claim(job.master_port)
    if holder is not None and port_is_free(job.master_port):
        return job.master_port, holder
    if holder is not None:
        holder.close()
    if not job.port_chosen:
        raise LaunchError(f"--master_port {job.master_port}: another job on this machine took the port; choose "
                          "another, or leave --master_port out to have a free one picked.")
    for _ in range(100):
        port = free_port()
        holder = claim(port)
        if holder is not None:
            say_port_replaced(job.master_port, port)
            return port, holder
    raise LaunchError("no free master port found that no other shardwise job holds; pass --master_port.")


def say_port_replaced(taken: int, port: int) -> None:
    say(f"master port {taken} was taken between choosing it and starting the job; using free port {port} (pass "
        "--master_port to choose one).", "warning")


class _Stop(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Signals:
    """While the ranks run, the first of these signals ends the agent's wait (it passes the signal on to the
    ranks); one more while they stop means now: SIGKILL without the grace."""

    def __init__(self) -> None:
        self.stopping = False
        self.hurry = False

    def __call__(self, signum: int, _frame: object) -> None:
        if self.stopping:
            self.hurry = True
            return
        self.stopping = True
        raise _Stop(signum)

    @contextmanager
    def handled(self, names: tuple[str, ...]) -> Iterator[None]:
        previous = {getattr(signal, name): signal.signal(getattr(signal, name), self) for name in names}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)


class Ranks:
    """The job's processes, each in its own session (a terminal's Ctrl-C reaches the agent, which passes it on)."""

    def __init__(self, job: Job, folder: str, signals: Signals) -> None:
        self.job = job
        self.signals = signals
        self.error_files = [os.path.join(folder, f"rank{rank}.error.json") for rank in range(job.nproc)]
        self.processes: list[subprocess.Popen] = []
        self.ended: dict[int, float] = {}  # rank -> when the agent saw it end

    def start(self, port: int, python: list[str]) -> None:
        for rank in range(self.job.nproc):
            env = {**os.environ, **rank_env(self.job, rank, port, self.error_files[rank])}
            self.processes.append(subprocess.Popen([*python, *self.job.argv], env=env, start_new_session=True))

    def poll(self) -> None:
        for rank, process in enumerate(self.processes):
            if rank not in self.ended and process.poll() is not None:
                self.ended[rank] = time.time()

    def failed(self) -> list[int]:
        return [rank for rank in sorted(self.ended) if self.processes[rank].returncode != 0]

    def running(self) -> list[int]:
        return [rank for rank in range(len(self.processes)) if rank not in self.ended]

    def wait(self) -> None:
        """Until every rank has ended or one has failed."""
        while True:
            self.poll()
            if self.failed() or not self.running():
                return
            time.sleep(POLL_S)

    def stop(self, signum: int) -> None:
        """``signum`` to every rank still running; SIGKILL to those still there :data:`STOP_GRACE_S` later."""
        self.signals.stopping = True
        for rank in self.running():
            _send(self.processes[rank], signum)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.running() and time.monotonic() < deadline and not self.signals.hurry:
            time.sleep(POLL_S)
            self.poll()
        for rank in self.running():
            _send(self.processes[rank], signal.SIGKILL)
            self.processes[rank].wait()
        self.poll()

    def failures(self) -> list[Failure]:
        host = host_name()
        return [failure_from_record(rank=self.job.first_rank + local, local_rank=local, pid=self.processes[local].pid,
                                    exitcode=self.processes[local].returncode, record=_read_json(self.error_files[local]),
                                    seen_at=self.ended[local], host=host)
                for local in self.failed()]


def run(job: Job) -> None:
    """Run the job to its end; raises :class:`RanksFailed` or :class:`AgentStopped` as torch's agent's errors do."""
    python = rank_python()
    port, holder = claim_master_port(job)
    folder = tempfile.mkdtemp(prefix="shardwise-job-")
    signals = Signals()
    ranks = Ranks(job, folder, signals)
    try:
        with signals.handled(job.signals):
            try:
                ranks.start(port, python)
                ranks.wait()
            except _Stop as stop:
                ranks.stop(stop.signum)
                raise AgentStopped(stop.signum) from None
            if ranks.failed():
                ranks.stop(signal.SIGTERM)
                raise RanksFailed(ranks.failures())
    finally:
        if ranks.running():  # the agent's own error: no rank outlives it
            ranks.stop(signal.SIGTERM)
        if holder is not None:
            holder.close()
        shutil.rmtree(folder, ignore_errors=True)


def _send(process: subprocess.Popen, signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
