"""From parsed launcher options to a multi-node plan (no torch): hostfile, filters, runner, env, rendezvous.

DeepSpeed's rule decides between one node and several: a hostfile (``--hostfile``, or ``/job/hostfile`` when
it exists) whose selection has more than one host — or ``--force_multi`` — is a multi-node job; otherwise the
job runs on this machine with the selected slots.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import uuid
from typing import TYPE_CHECKING

from shardwise.launcher import hostfile, netutil, remote_env, runners
from shardwise.launcher.hostfile import Node
from shardwise.launcher.jobspec import Elastic, JobSpec
from shardwise.launcher.multinode import MultiNodeLaunch

if TYPE_CHECKING:
    from shardwise.launcher.local import LocalLaunch

DEFAULT_MASTER_PORT = 29500


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


def plan_multinode(args: argparse.Namespace, nodes: tuple[Node, ...]) -> MultiNodeLaunch:
    runner = args.launcher or "pdsh"
    if runner not in runners.RUNNERS:
        raise hostfile.HostfileError(f"--launcher {runner!r}: choose one of {', '.join(runners.RUNNERS)}.")
    master_addr = args.master_addr or nodes[0].host
    script = args.command[0]
    # A script path is made absolute: every node starts in this directory, but be explicit.
    script = os.path.abspath(script) if script_mode(args) == "path" else script
    spec = JobSpec(
        nodes=tuple((n.host, n.slots) for n in nodes), script=script, script_args=tuple(args.command[1:]),
        mode=script_mode(args), pass_local_rank=not args.no_local_rank, master_addr=master_addr,
        master_port=master_port(args, master_addr), run_id=uuid.uuid4().hex[:12],
        elastic=elastic_policy(args, len(nodes)),
        each_rank_log=os.path.abspath(args.enable_each_rank_log) if args.enable_each_rank_log else None,
        pid_file=pid_file_path() if args.save_pid else None,
    )
    return MultiNodeLaunch(
        spec=spec, runner=runner, python=sys.executable, cwd=os.getcwd(),
        env=remote_env.carried_env(os.environ, os.getcwd(), os.path.expanduser("~")),
        launcher_args=tuple(shlex.split(args.launcher_args or "")), ssh_port=args.ssh_port,
    )


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


POD_VARS = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def as_pod_of_job(args: argparse.Namespace, plan: LocalLaunch) -> LocalLaunch:
    """In a Kubeflow PyTorchJob pod (``PET_*`` set by the operator, no hostfile), this launch is one node of
    the operator's job: its node rank, node count, master and ``nprocPerNode`` come from the operator."""
    env = os.environ
    if args.hostfile is not None or not all(env.get(v) for v in POD_VARS):
        return plan
    from dataclasses import replace

    nproc = env.get("PET_NPROC_PER_NODE", "")
    return replace(
        plan, nnodes=env["PET_NNODES"], node_rank=int(env["PET_NODE_RANK"]), master_addr=env["PET_MASTER_ADDR"],
        master_port=int(env["PET_MASTER_PORT"]),
        nproc=int(nproc) if nproc.isdigit() and args.num_gpus is None else plan.nproc,
    )
