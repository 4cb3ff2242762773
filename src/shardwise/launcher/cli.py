"""A launch: ``shardwise [launcher options] script.py [script args]`` checked, planned and started.

Starts one process per device on this machine or on every node of a hostfile; every flag of DeepSpeed's
``deepspeed`` command is accepted (``flags.py`` is the table). The ``shardwise`` and ``deepspeed`` commands
(``shardwise/cli.py``) call :func:`run_launch` when the first argument names no subcommand; the tools that start
processes (``shardwise autotune``, ``check-comm``) call it too.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Callable

from shardwise.launcher import affinity
from shardwise.launcher.flags import LaunchError, parse_launch_args
from shardwise.launcher.hostfile import Node

if TYPE_CHECKING:
    from shardwise.launcher.local import LocalLaunch
    from shardwise.launcher.multinode import MultiNodeLaunch

__all__ = ["Autotune", "LaunchError", "launch", "plan_launch", "run_launch"]
MULTI_NODE_ERROR = "several nodes need a --hostfile listing them ('<host> slots=<N>' per line)"
# `--autotuning MODE`: the tuner gets the whole argument list, MODE ("tune" or "run") and the command's name.
Autotune = Callable[[list[str], str, str], int]


def check_options(args: argparse.Namespace, hostfile: str | None) -> None:
    """Counts, combinations and refusals that need no hostfile: fast, before torch is imported."""
    if hostfile is None and args.num_nodes is not None and args.num_nodes > 1:
        raise LaunchError(f"--num_nodes {args.num_nodes}: {MULTI_NODE_ERROR}.")
    for flag in ("num_nodes", "num_gpus"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise LaunchError(f"--{flag} must be at least 1 (or -1 for all); got {value}.")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together; keep one.")
    if args.node_rank is not None and not args.no_ssh:
        raise LaunchError(f"--node_rank {args.node_rank}: used only with --no_ssh (each node's launcher started by "
                          "hand); add --no_ssh, or drop --node_rank to have every node started from here.")
    if args.bind_core_list is not None and not args.bind_cores_to_rank:
        raise LaunchError(f"--bind_core_list {args.bind_core_list}: only used with --bind_cores_to_rank; add it to "
                          "bind each rank to its share of these cores, or drop --bind_core_list.")
    if args.enable_each_rank_log and os.path.isfile(args.enable_each_rank_log):
        raise LaunchError(f"--enable_each_rank_log {args.enable_each_rank_log}: is a file; give a directory.")
    if args.venv_script and not os.path.isfile(args.venv_script):
        raise LaunchError(f"--venv_script {args.venv_script}: no such file (cwd {os.getcwd()}).")
    if args.bind_core_list is not None:
        affinity.parse_core_list(args.bind_core_list)


def check_script(args: argparse.Namespace) -> None:
    """A script path must name a file; module names and executables are left to the worker to resolve."""
    if not args.command:
        raise LaunchError("no script given; pass the training script after the options (see --help).")
    script = args.command[0]
    if args.module or args.no_python or os.path.isfile(script):
        return
    where = "it is a directory" if os.path.isdir(script) else f"no such file (cwd {os.getcwd()})"
    raise LaunchError(
        f"script {script!r}: {where}. Pass the path of a Python file, "
        "or --module to run an importable module by name."
    )


def check_binding(args: argparse.Namespace, nproc: int) -> None:
    """``--bind_cores_to_rank`` on this machine: every local rank must get at least one usable core."""
    from shardwise.launcher import planning

    setting = planning.bind_setting(args)
    if setting is not None:
        affinity.rank_share(affinity.node_cores(setting), nproc, 0)


def resolve_nproc(requested: int | None) -> int:
    """Number of local processes: ``--num_gpus`` (at most the visible CUDA devices, if any), or the default."""
    from shardwise.launcher import local

    if requested is None:
        return local.default_nproc()
    available = local.visible_cuda_devices()
    if 0 < available < requested:
        raise LaunchError(
            f"--num_gpus {requested}: this machine has {available} visible CUDA device(s); "
            f"ask for at most {available} or check CUDA_VISIBLE_DEVICES."
        )
    return requested


def resolve_master_port(requested: int | None, log_level: str = "info") -> int:
    """An explicit port must be valid and free; otherwise 29500, or a free port if that one is busy."""
    from shardwise.launcher import local, netutil

    if requested is None:
        return local.pick_default_master_port(log_level)
    if not 0 < requested < 65536:
        raise LaunchError(f"--master_port must be between 1 and 65535; got {requested}.")
    if not netutil.port_is_free(requested):
        raise LaunchError(
            f"--master_port {requested}: the port is in use on this machine; "
            "choose another, or leave --master_port out to have a free one picked."
        )
    return requested


def plan_launch(args: argparse.Namespace) -> LocalLaunch | MultiNodeLaunch:
    """Validate parsed options and turn them into a single-node, a multi-node or a ``--no_ssh`` node's plan."""
    from shardwise.launcher import planning  # no torch: argument errors come fast

    path = planning.hostfile_path(args)
    check_options(args, path)
    check_script(args)
    nodes = planning.select_nodes(args, path) if path else planning.scheduler_on_this_host(args)
    if args.no_ssh:  # without a hostfile: this machine is the only node, as in DeepSpeed
        here = (Node("localhost", tuple(range(resolve_nproc(args.num_gpus)))),)
        plan = planning.plan_no_ssh(args, nodes or here)
        check_binding(args, plan.nproc)
        return plan
    if nodes is not None and planning.is_multinode(args, nodes):
        return planning.plan_multinode(args, nodes)
    if nodes is not None and path is not None:  # one host: run here on its selected slots, as DeepSpeed does
        planning.one_host_here(args, nodes[0], path)
    from shardwise.launcher import local

    nproc = nodes[0].nproc if nodes else resolve_nproc(args.num_gpus)
    check_binding(args, nproc)
    return planning.as_pod_of_job(args, local.LocalLaunch(
        nproc=nproc,
        script=args.command[0],
        script_args=tuple(args.command[1:]),
        master_addr=args.master_addr or local.DEFAULT_MASTER_ADDR,
        master_port=resolve_master_port(args.master_port, args.log_level),
        port_chosen=args.master_port is None,
        module=args.module,
        no_python=args.no_python,
        pass_local_rank=not args.no_local_rank,
        max_restarts=(3 if args.max_restarts is None else args.max_restarts) if args.elastic_training else 0,
        # Elastic on one node rendezvouses like torchrun --standalone: restarted workers get a fresh store
        # (see [Note: fresh store per round] in local.py); the static rendezvous keeps one for the whole job.
        rdzv_backend="c10d" if args.elastic_training else "static",
        rdzv_conf="is_host=1" if args.elastic_training else "",
        each_rank_log=args.enable_each_rank_log,
        pid_file=planning.pid_file_path() if args.save_pid else None,
        bind_cores=planning.bind_setting(args),
        venv_script=args.venv_script,
    ))


def launch(argv: list[str], prog: str = "shardwise", epilog: str | None = None,
           autotune: Autotune | None = None) -> int:
    """``shardwise [options] script [args]``: start the processes, return the job's exit status. ``autotune`` runs
    ``--autotuning``: the tuner sits above the launcher, which it uses, so the command passes it in."""
    args = parse_launch_args(argv, prog, epilog)
    if args.autotuning:  # the tuner launches the experiments, then (run) the training, through this launcher
        if autotune is None:
            raise LaunchError(f"--autotuning {args.autotuning}: this entry point only launches; run the shardwise or "
                              "deepspeed command (python -m shardwise.cli), which starts the tuner.")
        return autotune(argv, args.autotuning, prog)
    plan = plan_launch(args)
    from shardwise.launcher.multinode import MultiNodeLaunch, launch_multinode

    if isinstance(plan, MultiNodeLaunch):
        return launch_multinode(plan)
    from shardwise.launcher import local

    return local.launch_local(plan)


def _plan_errors() -> tuple[type[ValueError], ...]:
    """Errors of hostfiles, env files, runners and core lists: user errors, printed like ``LaunchError``."""
    from shardwise.launcher.affinity import CoreBindingError
    from shardwise.launcher.hostfile import HostfileError
    from shardwise.launcher.remote_env import EnvFileError
    from shardwise.launcher.runners import RunnerError

    return HostfileError, EnvFileError, RunnerError, CoreBindingError


def run_launch(argv: list[str], prog: str, epilog: str | None = None, autotune: Autotune | None = None) -> int:
    """:func:`launch` with the user's errors printed as ``<prog>: error: ...``; returns the exit status."""
    try:
        return launch(argv, prog, epilog, autotune)
    except (LaunchError, *_plan_errors()) as error:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":  # `python -m shardwise.launcher.cli`: a launch, without the subcommands
    sys.exit(run_launch(sys.argv[1:], "shardwise"))
