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

MULTI_NODE_ERROR = "multi-node launching is not available yet; use torchrun on each node"


class LaunchError(ValueError):
    """A launcher argument is wrong; the message says which and how to fix it."""


class Subcommand(NamedTuple):
    """A ``shardwise <name> ...`` tool: ``run`` gets the arguments after the name, returns the exit status."""

    summary: str
    run: Callable[[list[str]], int]


# Filled in by later tools (``report``, ``checkpoint``); a launch is whatever is not a subcommand.
SUBCOMMANDS: dict[str, Subcommand] = {}


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
    add("--num_nodes", "--num-nodes", type=int, default=None, metavar="N", help="only 1 is supported for now")
    add("--hostfile", default=None, help="multi-node hostfile (not supported yet)")
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


def check_counts(args: argparse.Namespace) -> None:
    """Refuse multi-node requests (until the multi-node runners exist) and process counts below one."""
    if args.hostfile is not None:
        raise LaunchError(f"--hostfile {args.hostfile}: {MULTI_NODE_ERROR}.")
    if args.num_nodes is not None and args.num_nodes > 1:
        raise LaunchError(f"--num_nodes {args.num_nodes}: {MULTI_NODE_ERROR}.")
    if args.num_nodes is not None and args.num_nodes < 1:
        raise LaunchError(f"--num_nodes must be 1 (this machine); got {args.num_nodes}.")
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
    from shardwise.launcher import local

    if requested is None:
        return local.pick_default_master_port()
    if not 0 < requested < 65536:
        raise LaunchError(f"--master_port must be between 1 and 65535; got {requested}.")
    if not local.port_is_free(requested):
        raise LaunchError(
            f"--master_port {requested}: the port is in use on this machine; "
            "choose another, or leave --master_port out to have a free one picked."
        )
    return requested


def plan_launch(args: argparse.Namespace) -> LocalLaunch:
    """Validate parsed options and turn them into a single-node launch plan."""
    check_counts(args)
    check_script(args)
    from shardwise.launcher import local  # after the checks: argument errors come without importing torch

    return local.LocalLaunch(
        nproc=resolve_nproc(args.num_gpus),
        script=args.command[0],
        script_args=tuple(args.command[1:]),
        master_addr=args.master_addr or local.DEFAULT_MASTER_ADDR,
        master_port=resolve_master_port(args.master_port),
        module=args.module,
        no_python=args.no_python,
        pass_local_rank=not args.no_local_rank,
    )


def launch(argv: list[str]) -> int:
    """``shardwise [options] script [args]``: start the processes, return the job's exit status."""
    plan = plan_launch(build_launch_parser().parse_args(argv))
    from shardwise.launcher import local  # torch is imported only when launching

    return local.launch_local(plan)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardwise`` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]].run(args[1:])
    try:
        return launch(args)
    except LaunchError as error:
        print(f"shardwise: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
