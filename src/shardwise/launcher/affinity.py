"""``--bind_cores_to_rank``: which cores each rank of a node gets, and pinning a rank to them (stdlib only).

As DeepSpeed's launcher does with numactl: the node's cores — ``--bind_core_list``, else one logical CPU per
physical core among those this process may use — are cut into equal consecutive shares, one per local rank
(cores left over stay unused). ``bootstrap.py`` pins its rank to its share with ``os.sched_setaffinity`` and
sets ``OMP_NUM_THREADS`` to the share's size before the script (and torch) starts. Unlike numactl, memory
is not bound to a NUMA node: pages land, by first touch, next to the cores that use them.

The launcher passes the setting to every rank in :data:`BIND_VAR`: ``all`` or the core list as given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

BIND_VAR = "SHARDWISE_BIND_CORES"
ALL = "all"


class CoreBindingError(ValueError):
    """``--bind_core_list`` is malformed, names unusable cores, or there are fewer cores than ranks."""


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4,7"`` → ``[0, 2, 3, 4, 7]``; items ascending and not overlapping, as DeepSpeed requires."""
    cores: list[int] = []
    for item in text.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise CoreBindingError(f"--bind_core_list {text!r}: item {item!r} is not a core number or a range "
                                   "like '4-7'; write e.g. '0-3,8,10-11' (no spaces).")
        first, last = int(low), int(high) if sep else int(low)
        if last < first or (cores and first <= cores[-1]):
            raise CoreBindingError(f"--bind_core_list {text!r}: item {item!r} is out of order or overlaps an "
                                   "earlier one; list the cores in ascending order, each once.")
        cores += range(first, last + 1)
    return cores


def format_core_list(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (the kernel's Cpus_allowed_list format)."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _sysfs_core(cpu: int) -> tuple[str, str] | None:
    """(package, core) of a logical CPU from sysfs; None where the kernel does not say."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as package, open(f"{base}/core_id") as core:
            return package.read().strip(), core.read().strip()
    except OSError:
        return None


def one_per_physical_core(cpus: Iterable[int],
                          core_of: Callable[[int], tuple[str, str] | None] = _sysfs_core) -> list[int]:
    """The first logical CPU of each physical core among ``cpus`` (hyperthread siblings dropped)."""
    seen: set[tuple[str, str]] = set()
    chosen = []
    for cpu in sorted(cpus):
        core = core_of(cpu)
        if core is not None and core in seen:
            continue
        chosen.append(cpu)
        if core is not None:
            seen.add(core)
    return chosen


def node_cores(setting: str, allowed: Iterable[int] | None = None) -> list[int]:
    """The cores to share out on this node: the list named by ``setting``, or one per physical core."""
    usable = set(os.sched_getaffinity(0) if allowed is None else allowed)
    if setting == ALL:
        return one_per_physical_core(usable)
    cores = parse_core_list(setting)
    missing = [c for c in cores if c not in usable]
    if missing:
        raise CoreBindingError(f"--bind_core_list {setting!r}: core(s) {format_core_list(missing)} are not available "
                               f"to this process (it may use {format_core_list(usable)}); list only those.")
    return cores


def rank_share(cores: list[int], local_size: int, local_rank: int) -> list[int]:
    """Local rank ``local_rank``'s consecutive share of ``cores`` (each rank gets the same count)."""
    per_rank = len(cores) // local_size
    if per_rank < 1:
        raise CoreBindingError(f"--bind_cores_to_rank: {len(cores)} core(s) ({format_core_list(cores)}) for "
                               f"{local_size} ranks on this node; each rank needs at least one. Start fewer ranks "
                               "per node (--num_gpus) or list more cores (--bind_core_list).")
    return cores[per_rank * local_rank: per_rank * (local_rank + 1)]


def bind_this_rank(setting: str, local_size: int, local_rank: int) -> list[int]:
    """Pin the calling process to its share and set ``OMP_NUM_THREADS``; returns the share."""
    share = rank_share(node_cores(setting), local_size, local_rank)
    os.sched_setaffinity(0, share)
    os.environ["OMP_NUM_THREADS"] = str(len(share))
    return share
