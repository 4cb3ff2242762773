"""`init_distributed`: join (or create) the default process group, DeepSpeed's signature."""

from __future__ import annotations

import atexit
import datetime
import logging
import time

import torch
import torch.distributed as dist

from .. import accelerator
from .env import discover
from .parent_watchdog import start_parent_watchdog

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
EXIT_GRACE_S = 0.05
_exit_hook_registered = False


def _let_comm_threads_finish() -> None:
    """Gloo's worker threads drop a finished collective (and its tensors) just after waking the waiter; a drop
    that must take the GIL once interpreter finalization has begun aborts the rank with SIGABRT ("terminate
    called without an active exception", torch 2.13). Sleeping hands them the GIL while it is still safe."""
    time.sleep(EXIT_GRACE_S)


def register_exit_hook() -> None:
    """Idempotent; called wherever shardwise starts using a process group (ours or the user's)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_let_comm_threads_finish)
        _exit_hook_registered = True


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise torch.distributed once; later calls are no-ops. MPI discovery arrives with multi-node."""
    if dist.is_initialized():
        register_exit_hook()
        return
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first, or drop dist_init_required."
        )
    env = discover(distributed_port)
    start_parent_watchdog()  # a rank whose launcher or node agent was SIGKILLed exits instead of training on
    if rank >= 0 and world_size > 0:
        env = type(env)(rank, world_size, env.local_rank, env.local_world_size, env.master_addr, env.master_port)
    env.export()
    backend = dist_backend or accelerator.backend()
    device = accelerator.device_for(env.local_rank)
    accelerator.set_device(device)
    if device.type == "cpu":
        torch.set_num_threads(accelerator.cpu_threads_per_rank(env.local_world_size))
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    register_exit_hook()
    if verbose and env.rank == 0:
        logger.info("shardwise: %d process(es), backend %s, master %s:%d", env.world_size, backend,
                    env.master_addr, env.master_port)
