"""The multi-process test harness: run a function on N gloo ranks and get each rank's result.

Forks N processes (fast: no re-import of torch), each with the env a launcher would set (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, a free MASTER_PORT) and one intra-op thread. A rank that raises
sends its traceback back; the parent raises one error with every failing rank's traceback. A hard
timeout kills every rank and names those that had not finished. A run whose ranks could not connect over
their port (taken by another test between choosing and binding it) is run once more on a fresh one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import re
import time
import traceback
from typing import Any, Callable

from shardwise.distributed.env import free_port


class RankFailure(AssertionError):
    pass


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, results: mp.Queue, args: tuple, kwargs: dict) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        value = fn(*args, **kwargs)
        # Plain pickle copies tensor bytes; torch's queue pickler would pass shared-memory handles
        # that die with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            _leave_after_peers(rank, world)
            dist.destroy_process_group()


# How long rank 0 waits for its peers to finish before leaving. It hosts the rendezvous store: leaving at once, it
# cut off a peer still setting up a process group or reading a key ("Connection reset by peer" in place of the
# peer's result, twice in a row on a loaded machine). A peer blocked in a collective with rank 0 (a test of a
# failing rank) is let go when the store goes, so the wait is short rather than until every peer is done.
LEAVE_GRACE_S = 3.0


def _leave_after_peers(rank: int, world: int) -> None:
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    try:
        store = _get_default_store()
        store.set(f"harness/done/{rank}", "1")
        if rank == 0 and world > 1:
            store.wait([f"harness/done/{r}" for r in range(1, world)], timedelta(seconds=LEAVE_GRACE_S))
    except Exception:  # noqa: BLE001 - a peer that did not finish in the grace, or a store already gone
        pass


def _check_alive(procs: list, outcomes: dict, results: mp.Queue) -> None:
    """A rank that died without reporting (a signal, os._exit) fails the run at once."""
    for rank, p in enumerate(procs):
        if rank not in outcomes and p.exitcode is not None:
            try:  # it may have reported just before exiting
                r, status, value = results.get(timeout=0.5)
                outcomes[r] = (status, value)
                return
            except queue.Empty:
                raise RankFailure(f"rank {rank} died (exit code {p.exitcode}) without reporting") from None


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    start_method: str = "fork", **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results in rank order. CUDA tests
    pass start_method="spawn" (a forked child cannot use CUDA once the parent has) and a module-level `fn`."""
    # torch.optim.Optimizer's constructor imports torch._dynamo on first use: 2-5 s of CPU per process, paid by
    # every rank of every test that builds an optimizer unless the parent has it before forking (a 37 s test
    # file of three runs took 6 s with it).
    import torch._dynamo  # noqa: F401

    try:
        return _run_once(fn, world_size, args, kwargs, timeout, start_method)
    except RankFailure as e:
        if not _lost_rendezvous(str(e)):
            raise
    # Another test on this machine took the port between free_port() and rank 0's bind (two pytest workers start
    # process groups side by side), so the ranks met a stranger's store: once more, on a fresh port.
    return _run_once(fn, world_size, args, kwargs, timeout, start_method)


# What a rank says when the process group could not be set up over the port it was given (never a test's failure).
_SETUP = re.compile(r"_new_process_group_helper|init_process_group|TCPStore|connectFullMesh")
_NETWORK = re.compile(r"DistNetworkError|Connection reset by peer|Connection refused|Address already in use")


def _lost_rendezvous(failure: str) -> bool:
    return bool(_SETUP.search(failure) and _NETWORK.search(failure))


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float,
              start_method: str) -> list[Any]:
    ctx = mp.get_context(start_method)
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, results, args, kwargs), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                _check_alive(procs, outcomes, results)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise RankFailure(f"timed out after {timeout:.0f}s; ranks {missing} did not finish") from None
                continue
            outcomes[rank] = (status, value)
            if status == "error":
                break  # the others are likely blocked in a collective with the failed rank
    finally:
        for p in procs:
            p.join(timeout=0.5 if len(outcomes) < world_size else 10)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise RankFailure("\n".join(f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(errors.items())))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
