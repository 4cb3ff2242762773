"""Console backend: rank 0's log lines, one per kind of event at each report.

    step 20 | loss 2.3104 | lr 1.000e-03 | loss scale 1 | grad norm 0.8123 | 310.2 samples/s | ...
    step 20 | time per step (ms) | forward 12.10 | backward 30.02 | backward_reduce 4.51 | step 3.20
    step 20 | memory (MB) | parameters 12.0 | master_weights 0.0 | gradients 12.0 | ...

The engine's events count samples on their step axis (DeepSpeed's "Train/Samples/..."); the console
shows optimizer steps, so it divides by the samples of one step. A user's own events
(`engine.monitor.write_events`) go to the file and dashboard backends only: scripts often write one
per step, which would drown the console.
"""

from __future__ import annotations

import logging
from typing import Sequence

from .base import Event

logger = logging.getLogger("shardwise")

ENGINE_PREFIX = "Train/Samples/"
TIMER_PREFIX = "elapsed_time_ms_"
_FORMATS = {
    "train_loss": "loss {:.4f}",
    "lr": "lr {:.3e}",
    "loss_scale": "loss scale {:g}",
    "grad_norm": "grad norm {:.4g}",
    "samples_per_sec": "{:.1f} samples/s",
    "tokens_per_sec": "{:,.0f} tokens/s",
    "tflops_per_rank": "{:.3g} TFLOPS/rank",
    "peak_memory_mb": "peak memory {:,.0f} MB",
}


def ensure_console_handler() -> None:
    """Show shardwise's INFO lines when the user's script configured no logging of its own."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[shardwise] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class ConsoleMonitor:
    def __init__(self, samples_per_step: int):
        self.samples_per_step = max(1, samples_per_step)

    def write_events(self, events: Sequence[Event]) -> None:
        lines: dict[tuple[int, str], list[str]] = {}
        for name, value, step in events:
            if not name.startswith(ENGINE_PREFIX):
                continue
            short = name[len(ENGINE_PREFIX):]
            key, part = _line_part(short, value)
            lines.setdefault((step // self.samples_per_step, key), []).append(part)
        for (step, heading), parts in lines.items():
            logger.info("step %d | %s%s", step, heading, " | ".join(parts))

    def close(self) -> None:
        pass


def _line_part(short: str, value: float) -> tuple[str, str]:
    """(line heading, text) of one engine event: timers and memory get lines of their own."""
    if short.startswith(TIMER_PREFIX):
        return "time per step (ms) | ", f"{short[len(TIMER_PREFIX):]} {value:.2f}"
    if short.startswith("memory_") and short.endswith("_mb"):
        return "memory (MB) | ", f"{short[len('memory_'):-len('_mb')]} {value:,.2f}"
    return "", _FORMATS.get(short, short + " {:.6g}").format(value)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's `log_dist`: log `message` on the listed global ranks ([-1]: every rank); with no ranks,
    only when no process group exists (a single process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        should = True
    else:
        ranks = ranks or []
        should = bool(ranks) and (ranks[0] == -1 or dist.get_rank() in ranks)
    if should:
        rank = dist.get_rank() if dist.is_initialized() else 0
        logger.log(level, "[Rank %d] %s", rank, message)
