"""The in-process side of an autotuning experiment: a run whose config the tuner wrote reports what the tuner
needs and stops, so that each experiment costs a few steps.

- `autotuning.model_info.profile`: after the first optimizer step, the model's shape and the activations of
  its first forward (the planner's inputs) and this rank's memory capacity go to `model_info_path`.
- `autotuning.metric_path`: optimizer steps `start_profile_step`..`end_profile_step` are timed wall to wall
  (data loading included, unlike DeepSpeed, which sums its forward/backward/step timers); step 2's peak
  memory is measured by the planner's probe (planner/probe.py), the largest over the ranks. The run stops
  early when the peak is over `memory_per_rank` (what an out-of-memory error would do on a device that
  size), or when the first timed step is already worse than `stop_below`.

Every rank stops at the same step: rank 0 writes the file, all meet at a barrier, then leave through
`SystemExit(0)`, which the launcher counts as success.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import accelerator
from ..config import Config
from ..monitor.reporter import StepFigures
from ..planner.probe import PlanProbe
from ..planner.shape import ActivationProfile, ModelShape
from ..profiling.memory import whole_numel

OK, OVER_BUDGET, HOPELESS = "ok", "over_budget", "hopeless"
"""What a finished experiment reports: measured; stopped at step 2 over its memory budget; stopped after the first
timed step, already worse than `stop_below`."""


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Atomically: a reader (the tuner, a resumed search) sees the whole file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


class Trial:
    def __init__(self, config: Config, module: torch.nn.Module, device: torch.device, rank: int, dp_size: int,
                 probe: PlanProbe, activations_peak: Any):
        self.config, self.module, self.device, self.rank, self.dp_size = config, module, device, rank, dp_size
        self.section = config.autotuning
        self.probe = probe
        self._activations_peak = activations_peak
        self._started: float | None = time.perf_counter() if self.section.start_profile_step == 1 else None
        self._flops = 0.0
        self._flops_per_token = 6.0 * _trainable(module) / dp_size  # forward 2N, backward 4N; each rank's share
        self._measured_peak: int | None = None

    def on_step(self, figures: StepFigures) -> None:
        section, step = self.section, figures.step
        if section.model_info.profile and step == 1:
            self._write_model_info()
            self._stop()
        if step == 2:
            self._measured_peak = self._peak()
            budget = section.memory_per_rank
            if budget is not None and self._measured_peak is not None and self._measured_peak > budget:
                self._finish(OVER_BUDGET)
        if step == section.start_profile_step - 1:
            accelerator.synchronize(self.device)
            self._started = time.perf_counter()
        if section.start_profile_step <= step <= section.end_profile_step:
            self._flops += self._flops_per_token * figures.tokens
        if step == section.start_profile_step and section.stop_below is not None and self._worse_than_bound(step):
            self._finish(HOPELESS, step)
        if step == section.end_profile_step:
            self._finish(OK, step)

    def close(self) -> None:
        pass

    # --- figures ---------------------------------------------------------------------------------
    def _metrics(self, step: int) -> dict[str, float]:
        accelerator.synchronize(self.device)
        assert self._started is not None
        steps = step - self.section.start_profile_step + 1
        latency = (time.perf_counter() - self._started) / steps
        return {"latency": latency * 1e3, "throughput": self.config.train_batch_size / latency,
                "FLOPS_per_gpu": self._flops / steps / latency, "timed_steps": steps}

    def _worse_than_bound(self, step: int) -> bool:
        """Rank 0's clock decides for all (ranks that disagreed would stop at different steps and hang)."""
        value, bound = _metric(self._metrics(step), self.section.metric), self.section.stop_below
        assert bound is not None
        worse = torch.tensor([float(value > bound if self.section.metric == "latency" else value < bound)],
                             device=self.device)
        dist.broadcast(worse, src=0)
        return bool(worse.item())

    def _peak(self) -> int | None:
        check = self.probe.check
        if check is None:
            return None
        peak = torch.tensor([check.measured], dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item())

    # --- reports -----------------------------------------------------------------------------------
    def _finish(self, status: str, step: int | None = None) -> None:
        if self.rank == 0:
            report: dict[str, Any] = {"status": status, "peak_memory": self._measured_peak,
                                      "planned_peak": self.probe.check.predicted if self.probe.check else None,
                                      "metric": self.section.metric}
            if step is not None:
                report |= self._metrics(step)
            assert self.section.metric_path is not None
            write_json(self.section.metric_path, report)
        self._stop()

    def _write_model_info(self) -> None:
        peak = self._activations_peak()
        width = 2 if (self.config.fp16.enabled or self.config.bf16.enabled) else 4
        activations = ActivationProfile(peak or 0, self.config.train_micro_batch_size_per_gpu, compute_bytes=width)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        capacities = [accelerator.memory_capacity(device, local_ranks) for device in (self.device, torch.device("cpu"))]
        capacity_t = torch.tensor(capacities, dtype=torch.float64, device=self.device)
        dist.all_reduce(capacity_t, op=dist.ReduceOp.MIN)
        if self.rank == 0:
            path = self.section.model_info_path or "model_info.json"
            # the config as the script handed it over: Hugging Face has filled its "auto" values by then
            resolved = json.loads(json.dumps(dict(self.config.items()), default=str))
            write_json(path, {"shape": ModelShape.of(self.module).to_json(), "activations": activations.to_json(),
                              "capacity_per_rank": int(capacity_t[0].item()), "device": self.device.type,
                              "host_capacity_per_rank": None if self.device.type == "cpu" else int(capacity_t[1].item()),
                              "dp_size": self.dp_size, "config": resolved})

    def _stop(self) -> None:
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(0)


def _metric(metrics: dict[str, float], name: str) -> float:
    return metrics["FLOPS_per_gpu"] if name.lower() == "flops" else metrics[name]


def _trainable(module: torch.nn.Module) -> int:
    return sum(whole_numel(p) for p in module.parameters() if p.requires_grad)
