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

import importlib
import sys
from typing import Callable, NamedTuple, Sequence

from .launcher.cli import run_launch

__all__ = ["SUBCOMMANDS", "Subcommand", "deepspeed_main", "main"]


class Subcommand(NamedTuple):
    """A ``shardwise <name> ...`` tool: ``run`` gets the arguments after the name, returns the exit status."""

    summary: str
    run: Callable[[list[str]], int]


def _tool(module: str, **kwargs: str) -> Callable[[list[str]], int]:
    """A subcommand implemented by ``<module>.main(argv, **kwargs)``, imported only when it runs (matplotlib, for
    one, only when plotting)."""

    def run(argv: list[str]) -> int:
        return int(importlib.import_module(module).main(argv, **kwargs) or 0)

    return run


SUBCOMMANDS: dict[str, Subcommand] = {
    "autotune": Subcommand("find the fastest config that fits: ZeRO stage, micro-batch, offload (= --autotuning tune)",
                           _tool("shardwise.autotune.cli", prog="shardwise autotune")),
    "checkpoint": Subcommand("inspect a checkpoint, or consolidate it to full weights (to-fp32)",
                             _tool("shardwise.checkpoint.cli")),
    "config": Subcommand("print the config's JSON schema for editors (shardwise config schema)",
                         _tool("shardwise.config.cli")),
    "estimate": Subcommand("model-state memory per rank at each ZeRO stage (--params 1.3e9 --num_gpus 8)",
                           _tool("shardwise.zero.estimate", prog="shardwise estimate")),
    "plan": Subcommand("planned per-rank peak memory of a config, by parts (--model M --config ds.json --world N)",
                       _tool("shardwise.planner.cli", prog="shardwise plan")),
    "plot": Subcommand("draw a run's CSV monitor curves (loss, lr, throughput, memory) to a PNG",
                       _tool("shardwise.monitor.plot")),
    "report": Subcommand("versions, devices and which optional pieces work here", _tool("shardwise.launcher.report")),
    "serve": Subcommand("an OpenAI-style completions endpoint for a Hugging Face model, split over --tp processes",
                        _tool("shardwise.inference.serve.cli")),
    "check-comm": Subcommand("sanity-test and time collectives between the ranks (takes launcher options)",
                             _tool("shardwise.launcher.check_comm")),
    "k8s": Subcommand("write a Kubeflow PyTorchJob (or Trainer v2 TrainJob) manifest for this training",
                      _tool("shardwise.launcher.k8s")),
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
