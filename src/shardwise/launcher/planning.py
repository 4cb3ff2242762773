"""From parsed launcher options to a plan (no torch): hostfile, filters, runner, env, rendezvous.

DeepSpeed's rule decides between one node and several: a hostfile (``--hostfile``, or ``/job/hostfile`` when
it exists) whose selection has more than one host — or ``--force_multi`` — is a multi-node job; otherwise the
job runs on this machine with the selected slots. With ``--no_ssh`` every node runs the launcher itself and
this one starts only the ranks of node ``--node_rank``, through the same per-node agent plan that ssh/pdsh
start remotely (``node.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from shardwise.launcher import affinity, hostfile, netutil, remote_env
from shardwise.launcher.flags import LaunchError
from shardwise.launcher.hostfile import Node
from shardwise.launcher.jobspec import Elastic, JobSpec
from shardwise.launcher.messages import say
from shardwise.launcher.multinode import MultiNodeLaunch

if TYPE_CHECKING:
    from shardwise.launcher.local import LocalLaunch

DEFAULT_MASTER_PORT = 29500
AGENT_RUNNERS = ("ssh", "pdsh")  # runners that start node.py on every node (and so can source --venv_script)


def hostfile_path(args: argparse.Namespace) -> str | None:
    if args.hostfile is not None:
        return str(args.hostfile)
    return hostfile.DEFAULT_HOSTFILE if os.path.isfile(hostfile.DEFAULT_HOSTFILE) else None


def select_nodes(args: argparse.Namespace, path: str) -> tuple[Node, ...]:
    return hostfile.select(hostfile.read_hostfile(path), args.include or "", args.exclude or "",
                           args.num_nodes, args.num_gpus)


def is_multinode(args: argparse.Namespace, nodes: tuple[Node, ...]) -> bool:
    return bool(args.force_multi) or len(nodes) > 1 or args.launcher in ("openmpi", "mpich", "slurm")


def elastic_policy(args: argparse.Namespace, node_count: int) -> Elastic | None:
    if not args.elastic_training:
        return None
    low = args.min_nodes if args.min_nodes is not None else 1
    high = args.max_nodes if args.max_nodes is not None else node_count
    if not 1 <= low <= high:
        raise hostfile.HostfileError(f"--min_nodes {low} / --max_nodes {high}: need 1 <= min_nodes <= max_nodes.")
    return Elastic(low, high, args.max_restarts if args.max_restarts is not None else 3)


def master_port(args: argparse.Namespace, master_addr: str) -> int:
    """An explicit port, or 29500 — checked free (or replaced by a free one) when the master is this machine."""
    if args.master_port is not None:
        return int(args.master_port)
    try:
        here = netutil.source_address(master_addr) == netutil.resolve(master_addr)
    except OSError:
        here = False
    if here and not netutil.port_is_free(DEFAULT_MASTER_PORT):
        return netutil.free_port()
    return DEFAULT_MASTER_PORT


def script_mode(args: argparse.Namespace) -> str:
    return "module" if args.module else "exec" if args.no_python else "path"


def job_spec(args: argparse.Namespace, nodes: tuple[Node, ...], port: int, run_id: str) -> JobSpec:
    """The job as every node agent sees it (a script path is made absolute: nodes start in this directory)."""
    script = args.command[0]
    return JobSpec(
        nodes=tuple((n.host, n.slots) for n in nodes),
        script=os.path.abspath(script) if script_mode(args) == "path" else script,
        script_args=tuple(args.command[1:]), mode=script_mode(args), pass_local_rank=not args.no_local_rank,
        master_addr=args.master_addr or nodes[0].host, master_port=port, run_id=run_id,
        elastic=elastic_policy(args, len(nodes)),
        each_rank_log=os.path.abspath(args.enable_each_rank_log) if args.enable_each_rank_log else None,
        pid_file=pid_file_path() if args.save_pid else None,
    )


def check_runner_options(args: argparse.Namespace, runner: str) -> None:
    """Refuse what the chosen runner cannot do; note the slurm-only tags it drops."""
    if runner in ("impi", "mvapich"):
        raise LaunchError(f"--launcher {runner}: not supported by shardwise; use --launcher mpich (its mpirun "
                          "-n/-ppn/-hosts/-genv options are also those of Intel MPI's and MVAPICH2's mpirun), "
                          "or openmpi, slurm, ssh, pdsh.")
    if args.venv_script and runner not in AGENT_RUNNERS:
        raise LaunchError(f"--venv_script: only the ssh and pdsh runners source it on the nodes; got --launcher "
                          f"{runner}, which starts ranks with this environment. Source it before launching instead.")
    if args.ssh_port and runner in ("mpich", "slurm"):
        raise LaunchError(f"--ssh_port {args.ssh_port}: --launcher {runner} does not take it; pass the port in "
                          "--launcher_args (srun uses no ssh), or use --launcher ssh, pdsh or openmpi.")
    for flag in ("comment", "account"):
        if getattr(args, flag) and runner != "slurm":
            say(f"--{flag} is passed on only by --launcher slurm (to srun); ignored for --launcher {runner}.",
                "info", args.log_level)


def plan_multinode(args: argparse.Namespace, nodes: tuple[Node, ...]) -> MultiNodeLaunch:
    runner = args.launcher
    check_runner_options(args, runner)
    master_addr = args.master_addr or nodes[0].host
    spec = job_spec(args, nodes, master_port(args, master_addr), uuid.uuid4().hex[:12])
    env = remote_env.carried_env(os.environ, os.getcwd(), os.path.expanduser("~"))
    if args.bind_cores_to_rank:  # every rank reads it, on its own node (see affinity.py)
        env[affinity.BIND_VAR] = args.bind_core_list or affinity.ALL
    return MultiNodeLaunch(
        spec=spec, runner=runner, python=sys.executable, cwd=os.getcwd(), env=env,
        launcher_args=tuple(shlex.split(args.launcher_args or "")), ssh_port=args.ssh_port,
        venv_script=os.path.abspath(args.venv_script) if args.venv_script else None,
        comment=args.comment, account=args.account, log_level=args.log_level,
    )


def plan_no_ssh(args: argparse.Namespace, nodes: tuple[Node, ...]) -> LocalLaunch:
    """``--no_ssh``: this node's agent only; every node's launcher computes the same job from the same options."""
    from shardwise.launcher import node

    rank = args.node_rank
    if rank is None or not 0 <= rank < len(nodes):
        raise LaunchError(f"--no_ssh needs --node_rank between 0 and {len(nodes) - 1} (this node's place among "
                          f"{', '.join(n.host for n in nodes)}); got {rank if rank is not None else 'none'}.")
    if args.launcher not in AGENT_RUNNERS:
        raise LaunchError(f"--no_ssh starts this node's ranks here; --launcher {args.launcher} would start every "
                          "node's from one place. Keep one of the two.")
    master_addr = args.master_addr or nodes[0].host
    # Every node must agree on the port and the run id without talking: no free-port fallback, no random id.
    port = args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
    if rank == 0 and args.master_port is None and not netutil.port_is_free(port):
        raise LaunchError(f"--master_port: the default {port} is in use on this machine (node 0); pass the same "
                          "free --master_port to every node.")
    spec = job_spec(args, nodes, port, f"shardwise-{master_addr}-{port}")
    node.node_env(spec, rank)
    return replace(node.agent_plan(spec, rank), bind_cores=bind_setting(args), venv_script=args.venv_script)


def bind_setting(args: argparse.Namespace) -> str | None:
    return (args.bind_core_list or affinity.ALL) if args.bind_cores_to_rank else None


def one_host_here(args: argparse.Namespace, node: Node, path: str) -> None:
    """A one-host hostfile runs on this machine (DeepSpeed's rule); say so when that host is another machine."""
    try:
        here = netutil.is_this_machine(node.host)
    except OSError:
        raise hostfile.HostfileError(
            f"--hostfile {path}: its only host {node.host!r} does not resolve here. A one-host hostfile runs on "
            "this machine: name this machine (or localhost) there; to run on another host, fix its name and "
            "pass --force_multi.") from None
    if not here:
        say(f"the hostfile {path} names one host, {node.host}, which is not this machine ({socket.gethostname()}); "
            f"running its {node.nproc} slot(s) here, as DeepSpeed does. Pass --force_multi to run on {node.host} "
            "over ssh instead.", "warning", args.log_level)
    use_slots_here(node)


def pid_file_path() -> str:
    """``--save_pid``: ``/tmp/<launcher pid>.shardwise``; every process of the job appends '<role> <host> <pid>'."""
    path = f"/tmp/{os.getpid()}.shardwise"
    with open(path, "w") as f:
        f.write(f"launcher {os.uname().nodename} {os.getpid()}\n")
    return path


def use_slots_here(node: Node) -> None:
    """A one-host hostfile runs on this machine; chosen slots become the visible devices."""
    if node.slots != tuple(range(node.nproc)):
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.slots))


def scheduler_on_this_host(args: argparse.Namespace) -> tuple[Node, ...] | None:
    """``--launcher openmpi|mpich|slurm`` without a hostfile: this machine, ``--num_gpus`` processes."""
    if args.launcher not in ("openmpi", "mpich", "slurm"):
        return None
    return (Node("localhost", tuple(range(args.num_gpus or 1))),)


def as_pod_of_job(args: argparse.Namespace, plan: LocalLaunch) -> LocalLaunch:
    """In a Kubeflow PyTorchJob or TrainJob pod (no hostfile), this launch is one node of the operator's job: its
    node rank, node count, master and processes per node come from the operator (``env.pod_of_job``)."""
    from shardwise.distributed.env import EnvError, pod_of_job  # only local launches get here

    if args.hostfile is not None:
        return plan
    try:
        pod = pod_of_job()
    except EnvError as error:
        raise LaunchError(str(error)) from None
    if pod is None:
        return plan
    nproc = pod.nproc if pod.nproc is not None and args.num_gpus is None else plan.nproc
    say(f"a Kubeflow pod ({pod.variables}): node {pod.node_rank} of {pod.nnodes}, {nproc} rank(s) here, master "
        f"{pod.master_addr}:{pod.master_port}.", "info", args.log_level)
    return replace(plan, nnodes=str(pod.nnodes), node_rank=pod.node_rank, master_addr=pod.master_addr,
                   master_port=pod.master_port, nproc=nproc)
