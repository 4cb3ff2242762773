"""One experiment: a candidate config run through the launcher with the user's own script for a few steps.

Each gets `<results_dir>/<name>/` with DeepSpeed's files (`ds_config.json`, `cmd.txt`, `exp.json`,
`metrics.json` from the run, `stdout.log`, `stderr.log`) and `result.json`, written last and atomically: a
search started again skips every experiment that has one (unless `overwrite`), so an interrupted search
resumes where it stopped. The profiling run that feeds the planner is cached the same way
(`<results_dir>/model_info.json`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..config.autotuning import AutotuningConfig
from ..planner.shape import ActivationProfile, ModelShape
from .search import FAILED, OUT_OF_MEMORY, TIMED_OUT, Outcome
from .space import ACCUMULATION, MICRO, Candidate, Space
from .trial import write_json

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--deepspeed-config")
_OUT_OF_MEMORY_WORDS = ("OutOfMemoryError", "CUDA out of memory", "DefaultCPUAllocator: can't allocate memory",
                        "MemoryError")


class ExperimentError(ValueError):
    pass


@dataclass(frozen=True)
class ModelInfo:
    shape: ModelShape
    activations: ActivationProfile
    capacity_per_rank: int
    device: str
    config: dict[str, Any]
    """The profiling run's config as its script passed it to the engine ("auto" values filled in)."""
    host_capacity_per_rank: int | None = None
    """Off CPU: the host memory one rank may fill with what it offloads (None on CPU, where it is the device)."""


@dataclass(frozen=True)
class Launch:
    """How the user launched the job: the launcher's options and the script with its arguments."""

    launcher_args: tuple[str, ...]
    script_args: tuple[str, ...]
    """The script and its arguments."""

    def config_path(self) -> str:
        index = _config_flag(self.script_args)
        if index is None:
            raise ExperimentError("autotuning: the script's arguments name no DeepSpeed config (--deepspeed_config PATH "
                                  "or --deepspeed PATH); the tuner passes each experiment's config through that flag.")
        return _flag_value(self.script_args, index)

    def argv(self, config: Path, arg_mappings: dict[str, str] | None, values: dict[str, Any]) -> list[str]:
        """The launcher's arguments for a run with `config`, and `values` through the script's own flags."""
        args = list(self.script_args)
        _set_flag(args, _config_flag(args), str(config))
        for key, flag in (arg_mappings or {}).items():
            if key.strip() in values:  # DeepSpeed's README spells one key with a trailing space
                _set_flag(args, _find_flag(args, flag), str(values[key.strip()]), flag)
        return [*self.launcher_args, *args]


class Experiments:
    def __init__(self, launch: Launch, space: Space, section: AutotuningConfig, dp_size: int):
        self.launch, self.space, self.section, self.dp_size = launch, space, section, dp_size
        self.results_dir = Path(section.results_dir or "autotuning_results")
        self.exps_dir = Path(section.exps_dir or "autotuning_exps")
        self.memory_per_rank = section.memory_per_rank

    def profile_model(self, candidate: Candidate) -> ModelInfo:
        """The planner's inputs, from one step of `candidate` (`Space.tightest`)."""
        path = self.results_dir / "model_info.json"
        if not path.is_file() or self.section.overwrite:
            autotuning = {"enabled": True, "model_info": {"profile": True}, "model_info_path": str(path.resolve())}
            status, reason, _ = self._launch("model_info", candidate, autotuning)
            if not path.is_file():
                raise ExperimentError(f"autotuning: the profiling run ({candidate.name}) did not report the model: "
                                      f"{reason or status}. Its output is in {self.results_dir / 'model_info'}/.")
        data = json.loads(path.read_text())
        return ModelInfo(ModelShape.from_json(data["shape"]), ActivationProfile.from_json(data["activations"]),
                         int(data["capacity_per_rank"]), data["device"],
                         {k: v for k, v in data["config"].items() if k != "autotuning"},
                         data.get("host_capacity_per_rank"))

    def finished(self, candidate: Candidate) -> bool:
        """Whether an earlier search measured `candidate` (and `overwrite` does not ask to again)."""
        return (self.results_dir / candidate.name / "result.json").is_file() and not self.section.overwrite

    def run(self, candidate: Candidate, stop_below: float | None) -> Outcome:
        result = self.results_dir / candidate.name / "result.json"
        if self.finished(candidate):
            return _outcome_from_json(candidate, json.loads(result.read_text()))
        autotuning = {"enabled": True, "metric": self.section.metric, "start_profile_step": self.section.start_profile_step,
                      "end_profile_step": self.section.end_profile_step,
                      "metric_path": str((self.results_dir / candidate.name / "metrics.json").resolve()),
                      "memory_per_rank": self.memory_per_rank, "stop_below": stop_below}
        started = time.monotonic()
        status, reason, metrics = self._launch(candidate.name, candidate, autotuning)
        metric = metrics.get("FLOPS_per_gpu" if self.section.metric.lower() == "flops" else self.section.metric)
        outcome = Outcome(candidate, status, metric=metric, measured=metrics.get("peak_memory"),
                          planned=metrics.get("planned_peak"), seconds=time.monotonic() - started, reason=reason,
                          figures=metrics)
        write_json(result, _outcome_to_json(outcome))
        return outcome

    def _launch(self, name: str, candidate: Candidate, autotuning: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        where = self.results_dir / name
        where.mkdir(parents=True, exist_ok=True)
        config = self.space.config(candidate, self.dp_size) | {"autotuning": autotuning}
        config_path = where / "ds_config.json"
        config_path.write_text(json.dumps(config, indent=2))
        values = {MICRO: candidate.micro, ACCUMULATION: candidate.accumulation}
        command = [sys.executable, "-m", "shardwise.cli",
                   *self.launch.argv(config_path.resolve(), self.section.arg_mappings, values)]
        (where / "cmd.txt").write_text(" ".join(command) + "\n")
        exp = {"name": name, "candidate": dataclasses.asdict(candidate), "ds_config": config}
        write_json(self.exps_dir / f"{name}.json", exp)
        write_json(where / "exp.json", exp)
        metrics_path = Path(autotuning.get("metric_path") or where / "metrics.json")
        metrics_path.unlink(missing_ok=True)
        code = _run(command, where, self.section.experiment_timeout_s)
        metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
        if metrics:
            return metrics["status"], "", metrics
        if code is None:
            return TIMED_OUT, f"still running after {self.section.experiment_timeout_s:g} s", {}
        tail = _tail(where / "stderr.log") + _tail(where / "stdout.log")
        if any(word in tail for word in _OUT_OF_MEMORY_WORDS):
            return OUT_OF_MEMORY, "out of memory", {}
        if code == 0:
            return FAILED, (f"the script ended without reaching step {self.section.end_profile_step}; let it train "
                            "that many steps, or lower autotuning.end_profile_step"), {}
        return FAILED, _last_error_line(tail), {}


def _run(command: list[str], where: Path, timeout: float) -> int | None:
    """The launcher's exit status, or None after `timeout` (then its whole process group is stopped)."""
    with open(where / "stdout.log", "w") as out, open(where / "stderr.log", "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            return None
        except BaseException:  # an interrupted search leaves no experiment behind
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise


def _config_flag(args: Sequence[str]) -> int | None:
    for flag in CONFIG_FLAGS:
        index = _find_flag(args, flag)
        if index is not None and _flag_value(args, index).endswith(".json"):
            return index
    return None


def _find_flag(args: Sequence[str], flag: str) -> int | None:
    for i, arg in enumerate(args[1:], start=1):  # args[0] is the script
        if arg == flag or arg.startswith(flag + "="):
            return i
    return None


def _flag_value(args: Sequence[str], index: int) -> str:
    arg = args[index]
    if "=" in arg:
        return arg.split("=", 1)[1]
    return args[index + 1] if index + 1 < len(args) else ""


def _set_flag(args: list[str], index: int | None, value: str, flag: str | None = None) -> None:
    if index is None:
        args += [flag or "", value]
    elif "=" in args[index]:
        args[index] = f"{args[index].split('=', 1)[0]}={value}"
    else:
        args[index + 1] = value


def _tail(path: Path, size: int = 20_000) -> str:
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(max(path.stat().st_size - size, 0))
        return f.read().decode(errors="replace")


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:300]


def _outcome_to_json(outcome: Outcome) -> dict[str, Any]:
    data = dataclasses.asdict(outcome)
    data.pop("resumed")
    return data


def _outcome_from_json(candidate: Candidate, data: dict[str, Any]) -> Outcome:
    data = {k: v for k, v in data.items() if k != "candidate"}
    return Outcome(candidate, **data, resumed=True)
