"""`shardwise autotune [launcher options] train.py [args]` (also `shardwise --autotuning tune|run ...` and
DeepSpeed's `deepspeed --autotuning ...`): profile the model once, search the config's space (space.py,
search.py) with a few steps per experiment, write the results, and with `run` train with the best config."""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable, Sequence

from pydantic import ValidationError

from ..config import ConfigError, parse_config
from ..config.autotuning import AutotuningConfig
from ..config.parse import load_raw
from ..launcher.cli import LaunchError, plan_launch, run_launch
from ..launcher.flags import parse_launch_args
from ..planner.changes import apply
from ..planner.oom import FIT_SHARE
from ..planner.plan import MemoryPlan, plan
from ..profiling.units import binary_bytes
from .experiment import ExperimentError, Experiments, Launch, ModelInfo
from .results import write_results
from .search import Outcome, Plan, Refusal, Search
from .space import Candidate, Space, SpaceError, read_space

def main(argv: Sequence[str] | None = None, prog: str = "shardwise autotune") -> int:
    return tune(list(sys.argv[1:] if argv is None else argv), "tune", prog)


def from_launcher(argv: Sequence[str], mode: str, prog: str) -> int:
    """The launcher's `--autotuning tune|run`: the same search; `run` then trains with the best config."""
    return tune(list(argv), mode, prog)


def tune(argv: list[str], mode: str, prog: str) -> int:
    try:
        args = parse_launch_args(argv, prog)
        if not args.command:
            raise LaunchError("no script given; pass the training script after the options, as for a launch.")
        launch = Launch(tuple(_without_autotuning(argv[:len(argv) - len(args.command)])), tuple(args.command))
        world = _world_size(plan_launch(args))
        raw = load_raw(launch.config_path())
        section = _section(raw)
        if world % section.mp_size:
            raise SpaceError(f"autotuning.mp_size ({section.mp_size}): must divide the {world} ranks launched.")
        dp_size = world // section.mp_size
        space = read_space(raw, dp_size, section)
        return _search(launch, space, section, dp_size, mode)
    except (LaunchError, SpaceError, ExperimentError, ConfigError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        return 2


def _search(launch: Launch, space: Space, section: AutotuningConfig, dp_size: int, mode: str) -> int:
    started = time.monotonic()
    experiments = Experiments(launch, space, section, dp_size)
    planned: Plan = lambda candidate: None  # noqa: E731
    refusal: Refusal = lambda candidate: None  # noqa: E731
    budget = section.memory_per_rank
    if section.tuner_type == "model_based":
        info = experiments.profile_model(space.tightest())
        planned, refusal = _planner(info, space, dp_size)
        budget = budget or int(FIT_SHARE * info.capacity_per_rank)
        _say(f"profiled the model: {info.shape.trainable / 1e6:.1f}M trainable parameters, "
             f"{binary_bytes(info.activations.saved_bytes)} of activations for a micro-batch of "
             f"{info.activations.micro_batch}; budget {binary_bytes(budget)} per rank")
    search = Search(space, section, _reporting(experiments), planned, budget, refusal)
    outcomes = search.run()
    best = search.best
    optimal = space.config(best.candidate, dp_size) if best else None
    config_path = experiments.results_dir / "ds_config_optimal.json"
    argv = launch.argv(config_path.resolve(), section.arg_mappings, _values(best)) if best else None
    text = write_results(experiments.results_dir, outcomes, best, section.metric, time.monotonic() - started, optimal,
                         ["shardwise", *argv] if argv else None, budget)
    print(text, flush=True)
    if best is None:
        print("autotune: no candidate ran to the end; see the table above and each experiment's stderr.log.",
              file=sys.stderr)
        return 1
    _say(f"best: {best.candidate.name}; its config is {config_path}")
    if mode == "run":
        assert argv is not None
        return run_launch(argv, "shardwise")
    return 0


def _planner(info: ModelInfo, space: Space, dp_size: int) -> tuple[Plan, Refusal]:
    """A candidate's planned peak per rank: on the device, or device and host together on CPU (one memory). It
    is planned from the profiling run's config as the script passed it on (Hugging Face's "auto" values filled
    in) with the candidate's settings over it. Off CPU, a candidate whose host part would not fit in the host
    memory a rank has is refused, as the out-of-memory explainer refuses to propose it."""

    @functools.cache
    def memory(candidate: Candidate) -> MemoryPlan | None:
        try:
            cfg = parse_config(apply(info.config, candidate.overrides(dp_size, space.nvme_path)), dp_size=dp_size)
        except ConfigError:
            return None
        return plan(info.shape, cfg, dp_size, info.activations)

    def planned(candidate: Candidate) -> int | None:
        peaks = memory(candidate)
        if peaks is None:
            return None
        return peaks.peak_total if info.device == "cpu" else peaks.peak_device

    def refusal(candidate: Candidate) -> str | None:
        peaks, host = memory(candidate), info.host_capacity_per_rank
        if peaks is None or host is None or peaks.peak_host <= FIT_SHARE * host:
            return None
        return (f"its host part ({binary_bytes(peaks.peak_host)} per rank) is over {FIT_SHARE:.0%} of the host "
                f"memory a rank has ({binary_bytes(host)})")

    return planned, refusal


def _reporting(experiments: Experiments) -> Callable[[Candidate, float | None], Outcome]:
    def reported(candidate: Candidate, stop_below: float | None) -> Outcome:
        if not experiments.finished(candidate):
            _say(f"{candidate.name}: running" + (f" (stops if below {stop_below:.4g})" if stop_below else ""))
        outcome = experiments.run(candidate, stop_below)
        figure = f", {outcome.metric:.4g}" if outcome.metric is not None else ""
        peak = f", peak {binary_bytes(outcome.measured)}" if outcome.measured else ""
        _say(f"{candidate.name}: {outcome.status}{figure}{peak}, {outcome.seconds:.1f} s"
             + (" (from an earlier run)" if outcome.resumed else "") + (f" - {outcome.reason}" if outcome.reason else ""))
        return outcome

    return reported


def _section(raw: dict[str, Any]) -> AutotuningConfig:
    try:
        return AutotuningConfig.model_validate(raw.get("autotuning") or {})
    except ValidationError as e:
        problems = [f"autotuning.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError(problems) from None


def _values(best: Outcome | None) -> dict[str, Any]:
    if best is None:
        return {}
    return {"train_micro_batch_size_per_gpu": best.candidate.micro,
            "gradient_accumulation_steps": best.candidate.accumulation}


def _without_autotuning(launcher_args: list[str]) -> list[str]:
    """The launcher's options without `--autotuning X` (any unique prefix, with or without '=')."""
    out, skip = [], False
    for arg in launcher_args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if len(name) > 6 and "--autotuning".startswith(name):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _world_size(plan: Any) -> int:
    spec = getattr(plan, "spec", None)
    if spec is not None:
        return sum(len(slots) for _, slots in spec.nodes)
    nodes = plan.nnodes.split(":")[-1]
    return plan.nproc * (int(nodes) if nodes.isdigit() else 1)


def _say(message: str) -> None:
    print(f"[autotune] {message}", flush=True)

