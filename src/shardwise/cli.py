"""The ``shardwise`` command: ``shardwise <subcommand> ...`` runs a tool, anything else is a launch.

``shardwise [launcher options] script.py [script args]`` starts one process per device on this machine or on
every node of a hostfile (``launcher/cli.py``); ``shardwise <subcommand> ...`` runs a tool instead. Subcommands
register in :data:`SUBCOMMANDS`, and a first argument naming one is never read as a script. :func:`deepspeed_main`
is the same launcher under DeepSpeed's name, for the ``deepspeed`` command of the compatibility distribution.

This table sits above every package rather than in ``launcher/``: the tools it lists (``autotune``, ``serve``,
``check-comm``) start their processes through the launcher. Each tool is imported only when it runs, so
``shardwise --help`` and a launch start without the training stack.
"""

from __future__ import annotations

import sys
from typing import Callable, NamedTuple, Sequence

from .launcher.cli import run_launch

__all__ = ["SUBCOMMANDS", "Subcommand", "deepspeed_main", "main"]


class Subcommand(NamedTuple):
    """A ``shardwise <name> ...`` tool: ``run`` gets the arguments after the name, returns the exit status."""

    summary: str
    run: Callable[[list[str]], int]


def _autotune(argv: list[str]) -> int:
    from .autotune.cli import main as autotune

    return autotune(argv, prog="shardwise autotune")


def _checkpoint(argv: list[str]) -> int:
    from .checkpoint.cli import main as checkpoint

    return checkpoint(argv)


def _config(argv: list[str]) -> int:
    from .config.cli import main as config

    return config(argv)


def _estimate(argv: list[str]) -> int:
    from .zero.estimate import main as estimate

    return estimate(argv, prog="shardwise estimate")


def _plan(argv: list[str]) -> int:
    from .planner.cli import main as plan

    return plan(argv, prog="shardwise plan")


def _plot(argv: list[str]) -> int:
    from .monitor.plot import main as plot  # matplotlib only when plotting

    return plot(argv)


def _report(argv: list[str]) -> int:
    from .launcher.report import main as report

    return report(argv)


def _serve(argv: list[str]) -> int:
    from .inference.serve.cli import main as serve

    return serve(argv)


def _check_comm(argv: list[str]) -> int:
    from .launcher.check_comm import main as check_comm

    return check_comm(argv)


def _k8s(argv: list[str]) -> int:
    from .launcher.k8s import main as k8s

    return k8s(argv)


SUBCOMMANDS: dict[str, Subcommand] = {
    "autotune": Subcommand("find the fastest config that fits: ZeRO stage, micro-batch, offload (= --autotuning tune)",
                           _autotune),
    "checkpoint": Subcommand("inspect a checkpoint, or consolidate it to full weights (to-fp32)", _checkpoint),
    "config": Subcommand("print the config's JSON schema for editors (shardwise config schema)", _config),
    "estimate": Subcommand("model-state memory per rank at each ZeRO stage (--params 1.3e9 --num_gpus 8)", _estimate),
    "plan": Subcommand("planned per-rank peak memory of a config, by parts (--model M --config ds.json --world N)",
                       _plan),
    "plot": Subcommand("draw a run's CSV monitor curves (loss, lr, throughput, memory) to a PNG", _plot),
    "report": Subcommand("versions, devices and which optional pieces work here", _report),
    "serve": Subcommand("an OpenAI-style completions endpoint for a Hugging Face model, split over --tp processes",
                        _serve),
    "check-comm": Subcommand("sanity-test and time collectives between the ranks (takes launcher options)", _check_comm),
    "k8s": Subcommand("write a Kubeflow PyTorchJob (or Trainer v2 TrainJob) manifest for this training", _k8s),
}


def subcommand_epilog() -> str:
    lines = [f"  {name:<12} {cmd.summary}" for name, cmd in sorted(SUBCOMMANDS.items())]
    return "subcommands (shardwise <subcommand> --help):\n" + "\n".join(lines)


def _autotuning(argv: list[str], mode: str, prog: str) -> int:
    """``--autotuning tune|run``: the tuner, which launches its experiments (and with ``run`` the training)."""
    from .autotune.cli import from_launcher

    return from_launcher(argv, mode, prog)


def _launch(argv: list[str], prog: str) -> int:
    epilog = subcommand_epilog() if prog == "shardwise" else None
    return run_launch(argv, prog, epilog, autotune=_autotuning)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardwise`` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]].run(args[1:])
    return _launch(args, "shardwise")


def deepspeed_main(argv: Sequence[str] | None = None) -> int:
    """Entry point for a ``deepspeed`` console script: the same launcher, named ``deepspeed`` in usage, help
    and errors, with no subcommands (DeepSpeed's ``deepspeed report`` would run a script named ``report``)."""
    return _launch(list(sys.argv[1:] if argv is None else argv), "deepspeed")


if __name__ == "__main__":
    sys.exit(main())
