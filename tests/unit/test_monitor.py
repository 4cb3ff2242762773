"""Monitors without processes: config sections, each backend's files read back, the console lines, the
rank-0-only fan-out, wandb's optional import, `shardwise plot`, and the phase timers."""

from __future__ import annotations

import csv
import logging
import sys
import types

import pytest
import torch

from shardwise.config import ConfigError, parse_config
from shardwise.cli import main as cli_main
from shardwise.monitor import FanOut, build_monitor, log_dir
from shardwise.monitor.console import ConsoleMonitor
from shardwise.monitor.csv_monitor import CSVMonitor
from shardwise.monitor.plot import panels
from shardwise.monitor.tensorboard_monitor import TensorBoardMonitor
from shardwise.profiling.timers import StepTimers

BASE = {"train_micro_batch_size_per_gpu": 4}
EVENTS = [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 1e-3, 8), ("Train/Samples/train_loss", 2.25, 16),
          ("my value", 7.0, 3)]


def test_deepspeed_monitor_sections_parse_with_their_defaults():
    cfg = parse_config({**BASE, "tensorboard": {"enabled": True, "output_path": "out/", "job_name": "bert"},
                        "csv_monitor": {"enabled": True}, "wandb": {"enabled": False, "team": "t", "project": "p"},
                        "flops_profiler": {"enabled": True, "profile_step": 3, "detailed": False},
                        "comms_logger": {"enabled": True, "prof_all": False,
                                         "prof_ops": ["all_reduce", "all_gather_into_tensor"]},
                        "memory_breakdown": True}, dp_size=1)
    assert log_dir(cfg.tensorboard).as_posix() == "out/bert"
    assert log_dir(cfg.csv_monitor).as_posix() == "runs/DeepSpeedJobName"  # DeepSpeed's "" output_path
    assert cfg.wandb.project == "p" and cfg.flops_profiler.module_depth == -1 and cfg.flops_profiler.top_modules == 1
    assert cfg.comms_logger.prof_ops == ["all_reduce", "all_gather"]  # torch's spelling accepted
    assert cfg.memory_breakdown


@pytest.mark.parametrize("section, message", [
    ({"tensorboard": {"enabled": True, "job_nme": "x"}}, "tensorboard.job_nme: unknown key. Did you mean 'job_name'?"),
    ({"comms_logger": {"prof_ops": ["alltoall"]}}, "comms_logger.prof_ops.0: must be one of all_reduce, reduce_scatter"),
    ({"flops_profiler": {"module_depth": -2}}, "flops_profiler.module_depth: input should be greater than or equal to -1"),
])
def test_bad_monitor_config_names_the_key(section, message):
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, **section}, dp_size=1)
    assert message in str(err.value)


def test_csv_files_follow_deepspeeds_layout(tmp_path):
    monitor = CSVMonitor(tmp_path / "job")
    monitor.write_events(EVENTS)
    with (tmp_path / "job" / "Train_Samples_train_loss.csv").open() as f:
        assert list(csv.reader(f)) == [["step", "train_loss"], ["8", "2.5"], ["16", "2.25"]]
    with (tmp_path / "job" / "my_value.csv").open() as f:
        assert list(csv.reader(f)) == [["step", "my value"], ["3", "7.0"]]


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = TensorBoardMonitor(tmp_path / "tb")
    monitor.write_events(EVENTS)
    monitor.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Train/Samples/train_loss")] == [(8, 2.5), (16, 2.25)]
    assert acc.Scalars("Train/Samples/lr")[0].value == pytest.approx(1e-3)


def test_console_lines(caplog):
    caplog.set_level(logging.INFO, logger="shardwise")
    ConsoleMonitor(samples_per_step=8).write_events([
        *EVENTS[:2], ("Train/Samples/elapsed_time_ms_forward", 12.345, 8), ("Train/Samples/memory_gradients_mb", 3.0, 8)])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step 1 | loss 2.5000 | lr 1.000e-03", "step 1 | time per step (ms) | forward 12.35",
                     "step 1 | memory (MB) | gradients 3.00"]


def _config(tmp_path, **extra):
    out = str(tmp_path / "out")
    return parse_config({**BASE, "csv_monitor": {"enabled": True, "output_path": out, "job_name": "j"},
                         "tensorboard": {"enabled": True, "output_path": out, "job_name": "j"}, **extra}, dp_size=1)


def test_only_rank_zero_writes(tmp_path):
    other = build_monitor(_config(tmp_path), rank=1)
    assert not other.enabled and other.backends == []
    other.write_events(EVENTS)
    assert not (tmp_path / "out").exists()
    zero = build_monitor(_config(tmp_path), rank=0)
    assert [type(b).__name__ for b in zero.backends] == ["ConsoleMonitor", "CSVMonitor", "TensorBoardMonitor"]
    zero.write_events(EVENTS)
    zero.close()
    names = sorted(p.name for p in (tmp_path / "out" / "j").iterdir())
    assert "Train_Samples_train_loss.csv" in names and any(n.startswith("events.out.tfevents") for n in names)


def test_wandb_missing_is_a_clear_error_on_every_rank(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    for rank in (0, 1):
        with pytest.raises(ValueError, match="wandb.enabled: the wandb package is not installed.*pip install wandb"):
            build_monitor(parse_config({**BASE, "wandb": {"enabled": True}}, dp_size=1), rank)


def test_wandb_backend_logs_events(monkeypatch):
    calls = []
    run = types.SimpleNamespace(finish=lambda: calls.append("finish"))
    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")  # so find_spec sees it
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    fake.log = lambda data, step: calls.append(("log", data, step))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    fan = build_monitor(parse_config({**BASE, "wandb": {"enabled": True, "team": "t", "group": "g", "project": "p"}},
                                     dp_size=1), rank=0)
    fan.write_events(EVENTS[:1])
    fan.close()
    assert calls == [("init", {"project": "p", "group": "g", "entity": "t"}),
                     ("log", {"Train/Samples/train_loss": 2.5}, 8), "finish"]


def test_fan_out_normalises_and_forwards():
    got = []
    backend = types.SimpleNamespace(write_events=got.extend, close=lambda: None)
    FanOut([backend]).write_events([("a", torch.tensor(1.5), torch.tensor(3))])
    assert got == [("a", 1.5, 3)] and isinstance(got[0][1], float)


def test_plot_draws_a_png(tmp_path, capsys):
    monitor = CSVMonitor(tmp_path / "run")
    for step in range(1, 21):
        monitor.write_events([("Train/Samples/train_loss", 3.0 / step, 8 * step), ("Train/Samples/lr", 1e-3, 8 * step),
                              ("Train/Samples/samples_per_sec", 100 + step, 8 * step),
                              ("Train/Samples/peak_memory_mb", 300.0, 8 * step),
                              ("Train/Samples/memory_parameters_mb", 0.5, 8 * step),
                              ("Train/Samples/elapsed_time_ms_forward", 5.0, 8 * step)])
    assert [p.title for p in panels(tmp_path)][:3] == ["loss", "learning rate", "samples / s"]
    assert cli_main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert f"wrote {png}" in capsys.readouterr().out


def test_plot_without_csv_files_says_what_to_do(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["plot", str(tmp_path)])
    assert "no CSV monitor files" in capsys.readouterr().err


def test_timers_cost_nothing_when_off_and_average_per_step(monkeypatch):
    import shardwise.profiling.timers as timers

    off = StepTimers(False, torch.device("cpu"))
    assert off("forward") is off("backward")  # one shared no-op context
    clock = iter(range(1000))  # a fake clock: every reading is 1 s after the previous one
    monkeypatch.setattr(timers, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    on = StepTimers(True, torch.device("cpu"))
    for _ in range(2):
        for _ in range(3):  # micro-steps of one optimizer step add up: 3 × 1 s per step
            with on("forward"):
                pass
        on.step_done()
    # 6 s over 2 steps: the mean per optimizer step (not per micro-step, 1 s; nor the sum, 6 s).
    assert on.take_means() == {"forward": 3.0}
    assert on.take_means() == {}


def test_progress_line_is_opt_in(monkeypatch):
    import io

    from rich.console import Console

    from shardwise.monitor.progress import StepProgress, progress_from_env
    from shardwise.monitor.reporter import StepFigures

    monkeypatch.delenv("SHARDWISE_PROGRESS", raising=False)
    assert progress_from_env(0) is None  # off inside user scripts
    monkeypatch.setenv("SHARDWISE_PROGRESS", "1")
    assert progress_from_env(1) is None  # never on other ranks
    out = io.StringIO()
    progress = StepProgress(total=10, console=Console(file=out, width=120, force_terminal=False))
    progress.update(StepFigures(3, 24, 2.5, 8, 0, [1e-3], 1.0, 0.5))
    progress.close()
    assert "step 3/10" in out.getvalue() and "loss 2.5000" in out.getvalue()
