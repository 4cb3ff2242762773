"""The node agent: what ssh/pdsh start on every node of a multi-node job.

``python -m shardwise.launcher.node <job spec> (--node_rank=N | --host=H)``

It connects the lifeline to the launcher ([Note: lifeline] in ``lifeline.py``), then runs this node's agent in
this process for its slots (``local.run_agent``: shardwise's own for a fixed world, whose ranks the job spec
gives, or PyTorch's elastic agent with its c10d rendezvous when elastic). It reports the node's first failing
rank — global rank, host, how it ended, traceback — or ``done``, and stops its ranks when the launcher closes the
lifeline or goes away.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from shardwise.launcher import bootstrap, netutil
from shardwise.launcher.failures import AgentStopped, RanksFailed, first_failure
from shardwise.launcher.flags import LaunchError
from shardwise.launcher.jobspec import JobSpec
from shardwise.launcher.lifeline import Lifeline
from shardwise.launcher.local import LocalLaunch, run_agent

KILL_AFTER_S = 10.0  # after the launcher went away: SIGTERM, then SIGKILL if this agent is still here


def parse_args(argv: list[str]) -> tuple[JobSpec, int]:
    if len(argv) != 2 or not argv[1].startswith(("--node_rank=", "--host=")):
        raise SystemExit("usage: python -m shardwise.launcher.node <job spec> (--node_rank=N | --host=H)")
    spec = JobSpec.decode(argv[0])
    key, value = argv[1][2:].split("=", 1)
    return spec, int(value) if key == "node_rank" else spec.node_rank_of(value)


def node_env(spec: JobSpec, node_rank: int) -> None:
    """Per-node settings for the ranks this agent starts."""
    host, slots = spec.nodes[node_rank]
    os.environ[bootstrap.HOST_VAR] = host
    if slots != tuple(range(len(slots))):  # --include/--exclude chose particular devices
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    if "GLOO_SOCKET_IFNAME" not in os.environ and len(spec.nodes) > 1:
        interface = netutil.interface_towards(spec.master_addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if spec.pid_file:
        os.environ[bootstrap.PID_FILE_VAR] = spec.pid_file


def agent_plan(spec: JobSpec, node_rank: int) -> LocalLaunch:
    host, slots = spec.nodes[node_rank]
    elastic = spec.elastic
    return LocalLaunch(
        nproc=len(slots), script=spec.script, script_args=spec.script_args, master_addr=spec.master_addr,
        master_port=spec.master_port, module=spec.mode == "module", no_python=spec.mode == "exec",
        pass_local_rank=spec.pass_local_rank, node_rank=node_rank, run_id=spec.run_id, local_addr=host,
        nnodes=f"{elastic.min_nodes}:{elastic.max_nodes}" if elastic else str(len(spec.nodes)),
        rdzv_backend="c10d" if elastic else "static", max_restarts=elastic.max_restarts if elastic else 0,
        each_rank_log=spec.each_rank_log, pid_file=spec.pid_file,
        # The first node serves the c10d store; torch's own guess compares host names, which fails for
        # nodes named by address on multi-homed machines (and in network namespaces).
        rdzv_conf=f"is_host={int(node_rank == 0)}" if elastic else "",
        # Every node's slots are in the spec: this node's ranks are known without torch's rendezvous.
        first_rank=None if elastic else sum(len(s) for _, s in spec.nodes[:node_rank]),
        world_size=None if elastic else sum(len(s) for _, s in spec.nodes),
    )


def run_node(spec: JobSpec, node_rank: int) -> int:
    host = spec.nodes[node_rank][0]
    node_env(spec, node_rank)
    lifeline = Lifeline(spec.lifeline_addrs.get(host, spec.master_addr), spec.lifeline_port, spec.lifeline_token,
                        node_rank, host)
    finished = threading.Event()

    def launcher_gone() -> None:
        if finished.is_set():
            return
        os.kill(os.getpid(), signal.SIGTERM)  # the agent turns SIGTERM into stopping every rank of this node
        # An agent blocked in a rendezvous may not act on it; dying makes every rank's watchdog stop it.
        if not finished.wait(KILL_AFTER_S):
            os.kill(os.getpid(), signal.SIGKILL)

    lifeline.watch(launcher_gone)
    try:
        run_agent(agent_plan(spec, node_rank))
    except RanksFailed as error:
        failure = first_failure(error.failures)
        finished.set()
        lifeline.send({"event": "failed", **failure.to_json()})
        print(f"shardwise: node {node_rank} ({host}): {failure.summary()}", file=sys.stderr, flush=True)
        return failure.exit_code()
    except AgentStopped as stop:
        finished.set()
        return 128 + stop.signum
    except BaseException:
        finished.set()
        raise
    finished.set()
    lifeline.send({"event": "done"})
    lifeline.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    spec, node_rank = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run_node(spec, node_rank)
    except ConnectionError as error:
        print(f"shardwise: {error}", file=sys.stderr, flush=True)
        return 1
    except LaunchError as error:  # e.g. node 0's master port held by another job
        print(f"shardwise: node {node_rank}: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
