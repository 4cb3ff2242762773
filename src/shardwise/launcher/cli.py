"""The ``shardwise`` command line: dispatches subcommands, otherwise parses and starts a launch.

``shardwise [launcher options] script.py [script args]`` starts one process per device on this machine
(DeepSpeed's launcher spellings are accepted). ``shardwise <subcommand> ...`` runs a tool instead; subcommands
register in :data:`SUBCOMMANDS`, and a first argument naming one is never read as a script.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

if TYPE_CHECKING:
    from shardwise.launcher.local import LocalLaunch
    from shardwise.launcher.multinode import MultiNodeLaunch

MULTI_NODE_ERROR = "several nodes need a --hostfile listing them ('<host> slots=<N>' per line)"


class LaunchError(ValueError):
    """A launcher argument is wrong; the message says which and how to fix it."""


class Subcommand(NamedTuple):
    """A ``shardwise <name> ...`` tool: ``run`` gets the arguments after the name, returns the exit status."""

    summary: str
    run: Callable[[list[str]], int]


# Filled in by later tools (``report``, ``checkpoint``); a launch is whatever is not a subcommand.
def _plot(argv: list[str]) -> int:
    from shardwise.monitor.plot import main as plot_main  # matplotlib only when plotting

    return plot_main(argv)


def _launcher_tool(module: str) -> Callable[[list[str]], int]:
    """A subcommand implemented by ``shardwise.launcher.<module>.main``, imported only when run."""

    def run(argv: list[str]) -> int:
        import importlib

        return int(importlib.import_module(f"shardwise.launcher.{module}").main(argv))

    return run


def _checkpoint(argv: list[str]) -> int:
    from shardwise.checkpoint.cli import main as checkpoint_main

    return checkpoint_main(argv)


SUBCOMMANDS: dict[str, Subcommand] = {
    "checkpoint": Subcommand("inspect a checkpoint, or consolidate it to full weights (to-fp32)", _checkpoint),
    "plot": Subcommand("draw a run's CSV monitor curves (loss, lr, throughput, memory) to a PNG", _plot),
    "report": Subcommand("versions, devices and which optional pieces work here", _launcher_tool("report")),
    "check-comm": Subcommand("sanity-test and time collectives between the ranks (takes launcher options)",
                             _launcher_tool("check_comm")),
    "k8s": Subcommand("write a Kubeflow PyTorchJob manifest for this training", _launcher_tool("k8s")),
}


def build_launch_parser() -> argparse.ArgumentParser:
    """Options of a launch; names follow DeepSpeed's launcher (underscores), dashed forms also work."""
    parser = argparse.ArgumentParser(
        prog="shardwise",
        usage="shardwise [options] script.py [script args]  |  shardwise <subcommand> ...",
        description="Start one training process per device on this machine (via torch.distributed.run).",
        epilog=_subcommand_epilog(),
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--num_gpus", "--num-gpus", type=int, default=None, metavar="N",
        help="processes to start (CPU processes on a machine without GPUs); default: one per CUDA device, or 1")
    add("--num_nodes", "--num-nodes", type=int, default=None, metavar="N", help="use the first N hosts of the hostfile")
    add("--hostfile", default=None, help="lines '<host> slots=<N>' (default /job/hostfile when it exists)")
    add("-i", "--include", default="", help="only these hosts/slots: 'host1:0,1@host2'")
    add("-e", "--exclude", default="", help="all but these hosts/slots: 'host1:0,1@host2'")
    add("--launcher", default=None, choices=("pdsh", "ssh", "openmpi", "mpich", "slurm"),
        help="how processes reach the nodes (default pdsh)")
    add("--launcher_args", "--launcher-args", default="", metavar="ARGS", help="extra options for ssh/pdsh/mpirun/srun")
    add("--ssh_port", "--ssh-port", type=int, default=None, metavar="PORT", help="ssh port of the nodes")
    add("--force_multi", "--force-multi", action="store_true", help="multi-node mode even for a single host")
    add("--elastic_training", "--elastic-training", action="store_true",
        help="c10d rendezvous: nodes may leave and rejoin between --min_nodes and --max_nodes")
    add("--min_nodes", "--min-nodes", type=int, default=None, metavar="N", help="elastic: fewest nodes (default 1)")
    add("--max_nodes", "--max-nodes", type=int, default=None, metavar="N", help="elastic: most nodes (default all)")
    add("--max_restarts", "--max-restarts", type=int, default=None, metavar="N", help="elastic: restarts (default 3)")
    add("--save_pid", "--save-pid", action="store_true",
        help="write /tmp/<launcher pid>.shardwise listing every process of the job ('<role> <host> <pid>')")
    add("--enable_each_rank_log", "--enable-each-rank-log", default=None, metavar="DIR",
        help="send each rank's stdout/stderr to DIR/rank<R>.log")
    add("--master_addr", "--master-addr", default=None, metavar="ADDR", help="rendezvous address (default 127.0.0.1)")
    add("--master_port", "--master-port", type=int, default=None, metavar="PORT",
        help="rendezvous port (default 29500, or a free port if 29500 is busy)")
    add("--no_local_rank", "--no-local-rank", action="store_true",
        help="do not append --local_rank=<r> to the script's args (LOCAL_RANK is always in the env)")
    add("-m", "--module", action="store_true", help="run the script as a module, like python -m")
    add("--no_python", "--no-python", action="store_true", help="run the script as an executable, not with python")
    # One REMAINDER positional: everything from the script on belongs to the script, options included.
    add("command", nargs=argparse.REMAINDER, metavar="script [script args]",
        help="the training script (or module name with --module), then its args, passed unchanged")
    return parser


def _subcommand_epilog() -> str | None:
    if not SUBCOMMANDS:
        return None
    lines = [f"  {name:<12} {cmd.summary}" for name, cmd in sorted(SUBCOMMANDS.items())]
    return "subcommands:\n" + "\n".join(lines)


def check_counts(args: argparse.Namespace, hostfile: str | None) -> None:
    """Process counts must be at least one; several nodes need a hostfile that names them."""
    if hostfile is None and args.num_nodes is not None and args.num_nodes > 1:
        raise LaunchError(f"--num_nodes {args.num_nodes}: {MULTI_NODE_ERROR}.")
    if args.num_nodes is not None and args.num_nodes < 1:
        raise LaunchError(f"--num_nodes must be at least 1; got {args.num_nodes}.")
    if args.num_gpus is not None and args.num_gpus < 1:
        raise LaunchError(f"--num_gpus must be at least 1; got {args.num_gpus}.")


def check_script(args: argparse.Namespace) -> None:
    """A script path must name a file; module names and executables are left to the worker to resolve."""
    if not args.command:
        raise LaunchError("no script given; usage: shardwise [options] script.py [script args] (see --help).")
    script = args.command[0]
    if args.module or args.no_python or os.path.isfile(script):
        return
    where = "it is a directory" if os.path.isdir(script) else f"no such file (cwd {os.getcwd()})"
    raise LaunchError(
        f"script {script!r}: {where}. Pass the path of a Python file, "
        "or --module to run an importable module by name."
    )


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


def resolve_master_port(requested: int | None) -> int:
    """An explicit port must be valid and free; otherwise 29500, or a free port if that one is busy."""
    from shardwise.launcher import local, netutil

    if requested is None:
        return local.pick_default_master_port()
    if not 0 < requested < 65536:
        raise LaunchError(f"--master_port must be between 1 and 65535; got {requested}.")
    if not netutil.port_is_free(requested):
        raise LaunchError(
            f"--master_port {requested}: the port is in use on this machine; "
            "choose another, or leave --master_port out to have a free one picked."
        )
    return requested


def plan_launch(args: argparse.Namespace) -> LocalLaunch | MultiNodeLaunch:
    """Validate parsed options and turn them into a single-node or a multi-node launch plan."""
    from shardwise.launcher import planning  # no torch: argument errors come fast

    path = planning.hostfile_path(args)
    check_counts(args, path)
    check_script(args)
    nodes = planning.select_nodes(args, path) if path else planning.scheduler_on_this_host(args)
    if nodes is not None and planning.is_multinode(args, nodes):
        return planning.plan_multinode(args, nodes)
    if nodes is not None:  # one host: run here on its selected slots, as DeepSpeed does
        planning.use_slots_here(nodes[0])
    from shardwise.launcher import local  # after the checks: argument errors come without importing torch

    return planning.as_pod_of_job(args, local.LocalLaunch(
        nproc=nodes[0].nproc if nodes else resolve_nproc(args.num_gpus),
        script=args.command[0],
        script_args=tuple(args.command[1:]),
        master_addr=args.master_addr or local.DEFAULT_MASTER_ADDR,
        master_port=resolve_master_port(args.master_port),
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
    ))


def launch(argv: list[str]) -> int:
    """``shardwise [options] script [args]``: start the processes, return the job's exit status."""
    plan = plan_launch(build_launch_parser().parse_args(argv))
    from shardwise.launcher.multinode import MultiNodeLaunch, launch_multinode

    if isinstance(plan, MultiNodeLaunch):
        return launch_multinode(plan)
    from shardwise.launcher import local  # torch is imported only when launching

    return local.launch_local(plan)


def _plan_errors() -> tuple[type[ValueError], ...]:
    """Errors of hostfiles, env files and runners: user errors, printed like ``LaunchError``."""
    from shardwise.launcher.hostfile import HostfileError
    from shardwise.launcher.remote_env import EnvFileError
    from shardwise.launcher.runners import RunnerError

    return HostfileError, EnvFileError, RunnerError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardwise`` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]].run(args[1:])
    try:
        return launch(args)
    except (LaunchError, *_plan_errors()) as error:
        print(f"shardwise: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
