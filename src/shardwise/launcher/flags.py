"""The launcher's options: every flag of DeepSpeed's ``deepspeed`` command, and what shardwise does with it.

This parser is the one table of flags and their treatment (docs/guides/launching.md mirrors it). Names,
short forms and defaults follow DeepSpeed 0.19.8's launcher (``tests/data/deepspeed_0_19_8_launcher_flags.json``,
extracted by ``tools/extract_deepspeed_launcher_flags.py``), plus flags of older DeepSpeed releases
(``--elastic_training``, ``--min/max_elastic_nodes``, ``--comment``, ``--account``); dashed spellings work too.
Each help text says what the flag does here; a flag shardwise cannot honour is refused when the launch is
planned, with the reason, never ignored without a word.

:func:`parse_launch_args` also turns DeepSpeed's "not given" sentinels (``-1``, ``"None"``, ``""``) into
``None``, so ``--num_nodes=-1`` means exactly what leaving the flag out means.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LAUNCHERS = ("pdsh", "ssh", "openmpi", "mpich", "slurm", "impi", "mvapich")  # impi, mvapich: refused, see planning
UNSET_INTS = ("num_nodes", "num_gpus", "node_rank", "min_nodes", "max_nodes")


class LaunchError(ValueError):
    """A launcher argument is wrong; the message says which and how to fix it."""


def _both(name: str) -> tuple[str, ...]:
    """DeepSpeed's underscore spelling and the dashed one (when they differ)."""
    dashed = name.replace("_", "-")
    return (f"--{name}", f"--{dashed}") if dashed != name else (f"--{name}",)


def _where(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("which machines and devices")
    add = group.add_argument
    add("-H", *_both("hostfile"), default=None, metavar="FILE",
        help="lines '<host> slots=<N>' (default /job/hostfile when it exists, else this machine). A hostfile "
             "with one host runs on this machine, as DeepSpeed does (said when that host is another machine; "
             "refused when its name does not resolve); --force_multi runs on it over ssh instead")
    add("-i", "--include", default="", metavar="SPEC", help="only these hosts/slots: 'host1:0,1@host2'")
    add("-e", "--exclude", default="", metavar="SPEC", help="all but these hosts/slots: 'host1:0,1@host2'")
    add(*_both("num_nodes"), type=int, default=None, metavar="N",
        help="use the first N hosts of the hostfile (-1, DeepSpeed's default: all)")
    add(*_both("num_gpus"), *_both("num_accelerators"), type=int, default=None, metavar="N", dest="num_gpus",
        help="processes per node, on devices [0, N) (CPU processes on a machine without GPUs); default "
             "(-1): one per visible CUDA device or hostfile slot, or 1")
    add(*_both("force_multi"), action="store_true",
        help="multi-node mode (ssh/pdsh/mpirun/srun) even for a one-host hostfile: runs on that host")


def _rendezvous(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rendezvous")
    add = group.add_argument
    add(*_both("master_addr"), default=None, metavar="ADDR",
        help="address of rank 0's node (default: the first host of the hostfile, or 127.0.0.1)")
    add(*_both("master_port"), type=int, default=None, metavar="PORT",
        help="rendezvous port (default 29500; on this machine a free port if 29500 is busy)")
    add(*_both("no_ssh"), action="store_true",
        help="start only this node's ranks: run the same command on every node with its --node_rank (nodes "
             "and slots from the hostfile, rendezvous at --master_addr); nothing is started over ssh")
    add(*_both("node_rank"), type=int, default=None, metavar="R",
        help="with --no_ssh: this node's rank, 0 to nodes-1 (hostfile order); refused without --no_ssh")


def _runner(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-node runner")
    add = group.add_argument
    add("--launcher", default="pdsh", type=str.lower, choices=LAUNCHERS, metavar="{pdsh,ssh,openmpi,mpich,slurm}",
        help="how processes reach the nodes (default pdsh; any case). impi and mvapich are refused: use "
             "--launcher mpich, whose mpirun options (-n -ppn -hosts -genv) Intel MPI and MVAPICH2 also take")
    add(*_both("launcher_args"), default="", metavar="ARGS", help="extra options for ssh/pdsh/mpirun/srun, one string")
    add(*_both("ssh_port"), type=int, default=None, metavar="PORT",
        help="ssh port of the nodes (ssh, pdsh; Open MPI as --mca plm_rsh_args '-p PORT'; refused for mpich/slurm)")
    add(*_both("no_ssh_check"), action="store_true",
        help="accepted, no effect: shardwise makes no separate ssh test before a multi-node launch; a node that "
             "ssh cannot reach is reported, with ssh's own error, when its runner command fails")
    add(*_both("venv_script"), default=None, metavar="FILE",
        help="a script sourced before the job starts on every node (ssh, pdsh; on this machine for a one-node "
             "or --no_ssh launch), e.g. a venv's bin/activate; refused for openmpi/mpich/slurm")
    add("--comment", default="", metavar="TEXT",
        help="--launcher slurm: passed to srun --comment (elsewhere: a note, no effect)")
    add("--account", default="", metavar="NAME",
        help="--launcher slurm: passed to srun --account (elsewhere: a note, no effect)")


def _script(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the script")
    add = group.add_argument
    add("-m", "--module", action="store_true", help="run the script as a module, like python -m")
    add(*_both("no_python"), action="store_true", help="run the script as an executable, not with python")
    add(*_both("no_local_rank"), action="store_true",
        help="do not append --local_rank=<r> to the script's args (LOCAL_RANK is always in the env)")
    add(*_both("bind_cores_to_rank"), action="store_true",
        help="pin each rank to its own equal share of the node's cores (one CPU per physical core this process "
             "may use, or --bind_core_list) and set OMP_NUM_THREADS to the share's size; memory is not NUMA-bound")
    add(*_both("bind_core_list"), default=None, metavar="LIST",
        help="with --bind_cores_to_rank: the cores to share out, e.g. '0-3,8,10-11' (ascending, no overlaps)")


def _elastic(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("elastic training")
    add = group.add_argument
    add(*_both("elastic_training"), action="store_true",
        help="c10d rendezvous: ranks that fail are restarted, nodes may leave and rejoin between the min and max")
    add(*_both("min_nodes"), *_both("min_elastic_nodes"), type=int, default=None, metavar="N", dest="min_nodes",
        help="elastic: fewest nodes (default 1)")
    add(*_both("max_nodes"), *_both("max_elastic_nodes"), type=int, default=None, metavar="N", dest="max_nodes",
        help="elastic: most nodes (default: every node of the hostfile selection)")
    add(*_both("max_restarts"), type=int, default=None, metavar="N", help="elastic: restarts (default 3)")


def _output(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output and bookkeeping")
    add = group.add_argument
    add(*_both("save_pid"), action="store_true",
        help="write /tmp/<launcher pid>.shardwise listing every process of the job ('<role> <host> <pid>')")
    add(*_both("enable_each_rank_log"), default=None, metavar="DIR",
        help="send each rank's stdout/stderr to DIR/rank<R>.log (DeepSpeed's default 'None': off)")
    add(*_both("log_level"), default="info", type=str.lower, choices=LOG_LEVELS,
        help="the launcher's own messages: 'warning' hides its start line and notes, 'error' its warnings too "
             "(default info; shardwise's launcher has no debug output)")
    add("-q", "--quiet", action="store_true", help="same as --log_level error")
    add("--autotuning", default=None, choices=("tune", "run"),
        help="search the config's space for the fastest config that fits (tune), then train with it (run); "
             "see `shardwise autotune --help`")


def build_launch_parser(prog: str = "shardwise", epilog: str | None = None) -> argparse.ArgumentParser:
    """Every launch option; ``prog`` names the command in usage, help and errors."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [options] script.py [script args]" + ("  |  shardwise <subcommand> ..." if epilog else ""),
        description="Start one training process per device, on this machine or on every node of a hostfile\n"
                    "(via torch.distributed.run's elastic agent). Takes every flag of DeepSpeed's launcher.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the subcommand list one per line
        allow_abbrev=True,  # DeepSpeed's launcher takes unique prefixes (--num_gpu 2); so do we
    )
    for add_group in (_where, _rendezvous, _runner, _script, _elastic, _output):
        add_group(parser)
    # One REMAINDER positional: everything from the script on belongs to the script, options included.
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="script [script args]",
                        help="the training script (or module name with --module), then its args, passed unchanged")
    return parser


def normalize(args: argparse.Namespace) -> argparse.Namespace:
    """DeepSpeed's spelled-out defaults mean "not given": ``-1`` counts, ``"None"`` log dir, ``""`` address."""
    for name in UNSET_INTS:
        if getattr(args, name) == -1:
            setattr(args, name, None)
    if args.enable_each_rank_log == "None":
        args.enable_each_rank_log = None
    if args.quiet:
        args.log_level = "error"
    args.master_addr = args.master_addr or None
    return args


def parse_launch_args(argv: Sequence[str], prog: str = "shardwise", epilog: str | None = None) -> argparse.Namespace:
    return normalize(build_launch_parser(prog, epilog).parse_args(list(argv)))
