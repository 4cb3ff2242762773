"""The comms logger: a summary of every collective the library issued, read from `CommStats`.

`distributed/collectives.py` is the one place collectives pass; it already counts calls and bytes per
(op, group) and each message size's latency (issue → completed wait). This module only turns those
counters into figures and a table, and (when `verbose`) logs each collective as it completes.

[Note: bandwidth formulas] With S the message size in bytes (the full buffer: for all-gather the
gathered output, for reduce-scatter the unreduced input) and t the latency, the algorithm bandwidth is
S / t; the bus bandwidth rescales it to what each link carried, so that figures of different ops and
group sizes n compare with the hardware's peak (the convention of NCCL's performance tests):
all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast 1.
Latency here includes any compute the collective overlapped with, so bandwidths are lower bounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from .. import accelerator
from ..config.monitoring import CommsLoggerConfig
from ..distributed.collectives import CommStats
from .table import render_table
from .units import binary_bytes

logger = logging.getLogger("shardwise")


def bus_factor(op: str, n: int) -> float:
    """Bus bandwidth / algorithm bandwidth of `op` on `n` ranks (see [Note: bandwidth formulas])."""
    if n <= 1:
        return 0.0  # nothing crosses a link
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op: no bus-bandwidth formula for {op!r}; known: all_reduce, all_gather, reduce_scatter, "
                     "broadcast.")


@dataclass(frozen=True)
class CommRow:
    """One (op, group, message size) line of the summary."""

    op: str
    group: str
    group_size: int
    message_bytes: int
    count: int
    waited: int
    total_latency_s: float

    @property
    def avg_latency_s(self) -> float:
        return self.total_latency_s / self.waited if self.waited else 0.0

    @property
    def algbw_bytes_per_s(self) -> float:
        return self.message_bytes / self.avg_latency_s if self.avg_latency_s > 0 else 0.0

    @property
    def busbw_bytes_per_s(self) -> float:
        return self.algbw_bytes_per_s * bus_factor(self.op, self.group_size)


def comm_rows(stats: CommStats, ops: Iterable[str] | None = None) -> list[CommRow]:
    """Rows for `ops` (all when None), sorted by op, group, then message size."""
    wanted = None if ops is None else set(ops)
    rows = []
    for (op, group), op_stats in sorted(stats.ops.items()):
        if wanted is not None and op not in wanted:
            continue
        n = stats.group_sizes.get(group, 1)
        for size, s in sorted(op_stats.by_size.items()):
            rows.append(CommRow(op, group, n, size, s.calls, s.waited, s.latency_s))
    return rows


def _gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3f}"


def summary_table(rows: list[CommRow]) -> str:
    columns = ["Op", "Group", "Ranks", "Message size", "Count", "Total latency (ms)", "Avg latency (ms)",
               "algbw (GB/s)", "busbw (GB/s)"]
    body = [
        [r.op, r.group, r.group_size, binary_bytes(r.message_bytes), r.count, f"{r.total_latency_s * 1e3:.3f}",
         f"{r.avg_latency_s * 1e3:.3f}", _gbps(r.algbw_bytes_per_s), _gbps(r.busbw_bytes_per_s)]
        for r in rows
    ]
    total = sum(r.message_bytes * r.count for r in rows)
    title = f"Collectives issued by this rank ({sum(r.count for r in rows)} calls, {binary_bytes(total)})"
    return render_table(title, columns, body, right_from=2)


class CommsLogger:
    """Applies the `comms_logger` config to the shared `CommStats`: which ops the summary shows,
    per-collective log lines (`verbose`), device-synchronized latencies on GPUs while enabled."""

    def __init__(self, config: CommsLoggerConfig, stats: CommStats, device: torch.device, rank: int):
        self.config = config
        self.stats = stats
        self.rank = rank
        self.ops = None if config.prof_all or not config.prof_ops else tuple(config.prof_ops)
        if config.enabled:
            if device.type != "cpu":
                stats.synchronize = lambda: accelerator.synchronize(device)
            if config.verbose or config.debug:
                stats.on_complete = self._log_one

    def _log_one(self, op: str, group: str, nbytes: int, seconds: float) -> None:
        if self.ops is not None and op not in self.ops:
            return
        n = self.stats.group_sizes.get(group, 1)
        algbw = nbytes / seconds if seconds > 0 else 0.0
        logger.info("rank %d | comm op %s | group %s | msg size %s | time %.3f ms | algbw %s GB/s | busbw %s GB/s",
                    self.rank, op, group, binary_bytes(nbytes), seconds * 1e3, _gbps(algbw),
                    _gbps(algbw * bus_factor(op, n)))

    def rows(self) -> list[CommRow]:
        return comm_rows(self.stats, self.ops)

    def summary(self) -> str:
        return summary_table(self.rows())
