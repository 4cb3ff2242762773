"""Running a job on several nodes: start the runner commands, watch the job, stop it everywhere.

With ssh/pdsh the launcher holds a lifeline to every node agent ([Note: lifeline]): the first failing rank
anywhere stops the job on every node (the launcher closes all lifelines; each agent stops its ranks), and
the launcher prints that rank, its host and its traceback. Ctrl-C or SIGTERM on the launcher does the same;
a SIGKILLed launcher closes the lifelines by dying. With ``--elastic_training`` failures are left to the
elastic agents' restarts, and an ssh node whose agent was lost is started again to rejoin (at most
``--max_restarts`` times). mpirun/srun supervise their ranks themselves: the launcher only runs them.

This module imports no torch: the launcher process stays light; node agents import it on their nodes.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace

from shardwise.launcher import netutil, runners
from shardwise.launcher.failures import Failure, first_failure
from shardwise.launcher.jobspec import JobSpec
from shardwise.launcher.lifeline import LifelineServer
from shardwise.launcher.messages import say

CAUSE_GRACE_S = 5.0  # after a "connection closed"-type failure, how long to wait for the report of its cause
STOP_GRACE_S = 20.0  # after closing the lifelines, how long agents get to stop their ranks before we kill runners
POLL_S = 0.2


@dataclass(frozen=True)
class MultiNodeLaunch:
    spec: JobSpec
    runner: str
    python: str
    cwd: str
    env: dict[str, str]
    launcher_args: tuple[str, ...] = ()
    ssh_port: int | None = None
    venv_script: str | None = None  # ssh/pdsh: sourced on every node before its agent starts
    comment: str = ""  # slurm: srun --comment
    account: str = ""  # slurm: srun --account
    log_level: str = "info"  # which of the launcher's own lines to print (messages.py)

    def say(self, message: str, level: str = "error") -> None:
        say(message, level, self.log_level)


class Job:
    """The local runner processes of one job and what the node agents reported through their lifelines."""

    def __init__(self, plan: MultiNodeLaunch, server: LifelineServer, commands: list[runners.Command]) -> None:
        self.plan, self.server, self.commands = plan, server, commands
        self.procs = [self._start(c) for c in commands]
        self.failures: list[Failure] = []
        self.lost: list[int] = []
        self.done: set[int] = set()
        self.stop_reason: str | None = None
        self.stop_due: float | None = None  # a consequence was reported: stop then, unless a cause comes first
        self.stopped_at = 0.0
        self.signal: int | None = None
        self.restarts = 0

    @staticmethod
    def _start(command: runners.Command) -> subprocess.Popen[bytes]:
        # Own session: Ctrl-C reaches the launcher only, which stops the job in order (lifelines first).
        return subprocess.Popen(command.argv, env={**os.environ, **command.env}, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    @property
    def elastic(self) -> bool:
        return self.plan.spec.elastic is not None

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason, self.stopped_at = reason, time.monotonic()
            self.server.stop()

    def on_event(self, node: int, event: dict) -> None:
        kind = event.get("event")
        if kind == "failed":
            failure = Failure.from_json(event)
            self.failures.append(failure)
            if self.elastic:
                return
            if failure.consequence:  # its cause is likely on its way from another node: let it arrive
                self.stop_due = self.stop_due or time.monotonic() + CAUSE_GRACE_S
            else:
                self.stop("a rank failed")
        elif kind == "lost" and node not in self.done and self.stop_reason is None:
            self.lost.append(node)
            if self.elastic:
                self._rejoin(node)
            else:
                self.stop(f"the agent on node {node} was lost")
        elif kind == "done":
            self.done.add(node)

    def _rejoin(self, node: int) -> None:
        spec = self.plan.spec
        if self.plan.runner != "ssh" or self.restarts >= (spec.elastic.max_restarts if spec.elastic else 0):
            return
        self.restarts += 1
        self.plan.say(f"node {node} ({spec.nodes[node][0]}) was lost; starting its agent again to rejoin "
            f"(restart {self.restarts} of {spec.elastic.max_restarts}).", "warning")
        index = next(i for i, c in enumerate(self.commands) if c.node == node)
        self.procs[index] = self._start(self.commands[index])

    def check_runners(self) -> None:
        """An ssh that exits non-zero for a node that never reported: the node could not start."""
        for command, proc in zip(self.commands, self.procs):
            code = proc.poll()
            if code and command.node is not None and not self._reported(command.node) and not self.elastic:
                host = self.plan.spec.nodes[command.node][0]
                self.stop(f"the {self.plan.runner} command for node {command.node} ({host}) exited with {code} "
                          "before its agent reported (see its output above)")

    def _reported(self, node: int) -> bool:
        return node in self.done or node in self.lost or any(
            f.host == self.plan.spec.nodes[node][0] for f in self.failures)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill_runners(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    def watch(self) -> None:
        while self.running():
            try:
                self.on_event(*self.server.events.get(timeout=POLL_S))
            except queue.Empty:
                pass
            self.check_runners()
            if self.signal is not None:
                self.stop(f"stopped by {signal.Signals(self.signal).name}")
            if self.stop_due is not None and time.monotonic() > self.stop_due:
                self.stop("a rank failed")
            if self.stop_reason and time.monotonic() - self.stopped_at > STOP_GRACE_S:
                self.kill_runners()
        while not self.server.events.empty():
            self.on_event(*self.server.events.get())

    def outcome(self) -> int:
        """Print what happened; return the launcher's exit status."""
        nodes = len(self.plan.spec.nodes)
        failed = self.failures and (not self.elastic or not self.done)
        first = first_failure(self.failures) if failed else None
        # A lost agent explains its peers' "connection closed" failures (see [Note: first failure]).
        if first is not None and not (first.consequence and self.lost):
            tail = first.traceback_tail()
            self.plan.say(f"{first.summary()}. The job was stopped on all {nodes} node(s)."
                          + (f"\nTraceback of rank {first.rank}:\n{tail}" if tail else ""))
            return first.exit_code()
        if self.lost and (not self.elastic or not self.done):
            node = self.lost[0]
            self.plan.say(f"the node agent of node {node} ({self.plan.spec.nodes[node][0]}) was lost (killed, or its "
                          f"machine went down); the job was stopped on all {nodes} node(s).")
            return 1
        if self.signal is not None:
            self.plan.say(f"stopped by {signal.Signals(self.signal).name}; the job was stopped on all {nodes} node(s).")
            return 128 + self.signal
        if self.stop_reason:
            self.plan.say(f"{self.stop_reason}; the job was stopped on all {nodes} node(s).")
            return 1
        bad = [code for code in (p.returncode for p in self.procs) if code]
        if self.done and (self.elastic or not bad):
            return 0
        self.plan.say(f"the {self.plan.runner} command(s) ended without every node reporting; exit codes {bad or [0]}.")
        return abs(bad[0]) if bad else 1


def plan_spec(plan: MultiNodeLaunch, server: LifelineServer, token: str) -> MultiNodeLaunch:
    addrs = {}
    for host, _ in plan.spec.nodes:
        try:
            addrs[host] = netutil.source_address(host)
        except OSError as error:
            raise runners.RunnerError(f"hostfile host {host!r}: no route to it from this machine ({error}); "
                                      "check that the name resolves here and on every node.") from None
    spec = replace(plan.spec, lifeline_port=server.port, lifeline_token=token, lifeline_addrs=addrs)
    return replace(plan, spec=spec)


def agent_commands(plan: MultiNodeLaunch) -> list[runners.Command]:
    build = runners.ssh_commands if plan.runner == "ssh" else runners.pdsh_commands
    return build(plan.spec, plan.python, plan.cwd, plan.env, plan.launcher_args, plan.ssh_port, plan.venv_script)


def launch_agents(plan: MultiNodeLaunch) -> int:
    """ssh/pdsh: node agents with lifelines; returns the job's exit status."""
    token = secrets.token_hex(16)
    server = LifelineServer(token)
    plan = plan_spec(plan, server, token)
    job = Job(plan, server, agent_commands(plan))

    def on_signal(signum: int, _frame: object) -> None:
        job.signal = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        job.watch()
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return job.outcome()


def scheduler_commands(plan: MultiNodeLaunch, hostfile_dir: str) -> list[runners.Command]:
    spec, env = plan.spec, plan.env
    if plan.runner == "openmpi":
        path = os.path.join(hostfile_dir, "hostfile")
        with open(path, "w") as f:
            f.write(runners.openmpi_hostfile(spec))
        return runners.openmpi_commands(spec, plan.python, env, path, plan.launcher_args, as_root=os.geteuid() == 0,
                                        ssh_port=plan.ssh_port)
    if plan.runner == "mpich":
        return runners.mpich_commands(spec, plan.python, env, plan.launcher_args)
    return runners.slurm_commands(spec, plan.python, env, plan.launcher_args, plan.comment, plan.account)


def launch_scheduler(plan: MultiNodeLaunch) -> int:
    """openmpi/mpich/slurm: one mpirun/srun that starts and supervises every rank."""
    with tempfile.TemporaryDirectory(prefix="shardwise-") as tmp:
        (command,) = scheduler_commands(plan, tmp)
        proc = subprocess.Popen(command.argv, env={**os.environ, **command.env}, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            code = proc.wait()
    if code:
        plan.say(f"{command.argv[0]} exited with {code}; the failing rank's error is above.")
    return code


def require_tool(runner: str) -> None:
    tool = {"ssh": "ssh", "pdsh": "pdsh", "openmpi": "mpirun", "mpich": "mpirun", "slurm": "srun"}[runner]
    if shutil.which(tool) is None:
        hint = " or use --launcher ssh" if runner == "pdsh" else ""
        raise runners.RunnerError(f"--launcher {runner}: `{tool}` is not on PATH; install it{hint}.")


def launch_multinode(plan: MultiNodeLaunch) -> int:
    require_tool(plan.runner)
    nodes = plan.spec.nodes
    plan.say(f"{plan.spec.world_size} process(es) on {len(nodes)} node(s) ({', '.join(h for h, _ in nodes)}) via "
             f"{plan.runner}; master {plan.spec.master_addr}:{plan.spec.master_port}", "info")
    if plan.runner in ("ssh", "pdsh"):
        return launch_agents(plan)
    return launch_scheduler(plan)
