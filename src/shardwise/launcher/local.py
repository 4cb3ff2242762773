"""One node's launch: runs a :class:`LocalLaunch` plan under an agent and turns a failure into a message and a code.

A job with a fixed world whose ranks are known here (one node, or a node of a hostfile's job) runs under
``static_agent.py`` (stdlib only: see [Note: own agent] there); an elastic job, or a Kubeflow pod, under PyTorch's
elastic agent (``torch.distributed.run``), whose rendezvous it needs. Either agent gives the ranks torchrun's
variables (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT...) and stops the other ranks when one fails. torch
is imported only for the latter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, replace

from shardwise.distributed import parent_watchdog as watchdog
from shardwise.error_file import host_name
from shardwise.launcher import affinity, bootstrap, static_agent
from shardwise.launcher.failures import AgentStopped, Failure, RanksFailed, first_failure, from_child_failed
from shardwise.launcher.messages import say
from shardwise.launcher.netutil import free_port, port_is_free
from shardwise.launcher.remote_env import EnvFileError

DEFAULT_MASTER_ADDR = "127.0.0.1"
BASH_OWN_VARS = ("_", "SHLVL", "PWD", "OLDPWD")  # set by the bash that sources --venv_script, not by the script
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LocalLaunch:
    """Everything needed to start ``nproc`` workers of one script on this machine."""

    nproc: int
    script: str
    script_args: tuple[str, ...] = ()
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    module: bool = False
    no_python: bool = False
    pass_local_rank: bool = True
    # One node of several (set by ``node.py``): static rendezvous at master, or c10d for elastic jobs.
    nnodes: str = "1"
    node_rank: int = 0
    # Where every node's slots are known (a hostfile's job: ``node.agent_plan``): this node's first global rank and
    # the job's world size. None elsewhere (a Kubeflow pod knows only its own): torch's rendezvous finds them.
    first_rank: int | None = None
    world_size: int | None = None
    rdzv_backend: str = "static"
    run_id: str = "none"
    max_restarts: int = 0
    local_addr: str | None = None
    rdzv_conf: str = ""  # c10d only: "is_host=1" on the node that serves the rendezvous store
    each_rank_log: str | None = None  # --enable_each_rank_log DIR
    pid_file: str | None = None  # --save_pid: where every process of the job notes its pid
    bind_cores: str | None = None  # --bind_cores_to_rank: "all" or --bind_core_list (see affinity.py)
    venv_script: str | None = None  # --venv_script: sourced here, its variables given to the agent and ranks
    # Signals the agent answers by stopping the workers itself (torchrun's --signals-to-handle); None: torch's
    # default (SIGTERM, SIGINT, SIGHUP, SIGQUIT). `shardwise serve` keeps SIGTERM and SIGINT to stop its ranks.
    agent_signals: str | None = None
    # The master port was picked here (the default, or a free one), not asked for: if something else binds it
    # before the agent does, another is picked (one node only: other nodes could not follow).
    port_chosen: bool = False


def in_bootstrap(plan: LocalLaunch) -> LocalLaunch:
    """The same plan with every worker started through ``bootstrap.py`` (watchdog, error file, local rank).

    ``--local_rank`` is then added by the bootstrap (from ``LOCAL_RANK``), not by the agent's macro.
    """
    mode = "module" if plan.module else "exec" if plan.no_python else "path"
    head = ("--pass-local-rank",) if plan.pass_local_rank else ()
    return replace(plan, script="shardwise.launcher.bootstrap", script_args=(*head, mode, plan.script, *plan.script_args),
                   module=True, no_python=False, pass_local_rank=False)


# Without one of these no CUDA (or ROCm, which torch.cuda also counts) device can be visible.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def visible_cuda_devices() -> int:
    """CUDA devices this process may use (respects CUDA_VISIBLE_DEVICES); 0 on a CPU-only machine.

    Asks torch only where a GPU driver is present: elsewhere the answer is 0 without its ~2 CPU-s import.
    """
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_nproc() -> int:
    """Number of workers when none is asked for: one per visible CUDA device, else one CPU process."""
    return visible_cuda_devices() or 1


def worker_args(plan: LocalLaunch) -> list[str]:
    """The worker's argv after the script: DeepSpeed's ``--local_rank=<r>`` first, then the user's args.

    ``macros.local_rank`` is replaced by the elastic agent with each worker's local rank.
    """
    if not plan.pass_local_rank:
        return list(plan.script_args)
    from torch.distributed.elastic.utils import macros

    return [f"--local_rank={macros.local_rank}", *plan.script_args]


def torchrun_args(plan: LocalLaunch) -> argparse.Namespace:
    """The ``argparse.Namespace`` that ``torch.distributed.run.run`` takes for this plan.

    The script's own args are set after parsing so nothing in them is read as a torchrun option. A rank command
    of the user's (see [Note: rank python] in static_agent.py) is the agent's ``--no-python`` executable, with
    what torchrun would give python after it.
    """
    import torch.distributed.run as torchrun

    python = static_agent.rank_python()
    wrapped = python != [sys.executable]

    argv = [
        f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={plan.nproc}",
        f"--max-restarts={plan.max_restarts}",  # 0 unless elastic: one failing rank stops the job
        f"--rdzv-backend={plan.rdzv_backend}",
        f"--rdzv-id={plan.run_id}",
    ]
    if plan.rdzv_backend == "static":
        argv += [f"--node-rank={plan.node_rank}", f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}"]
    else:
        argv += [f"--rdzv-endpoint={plan.master_addr}:{plan.master_port}"]
        argv += [f"--rdzv-conf={plan.rdzv_conf}"] if plan.rdzv_conf else []
    argv += [f"--local-addr={plan.local_addr}"] if plan.local_addr else []
    argv += ["--module"] if plan.module and not wrapped else []
    argv += ["--no-python"] if plan.no_python or wrapped else []
    argv += [f"--signals-to-handle={plan.agent_signals}"] if plan.agent_signals else []
    program, before = (python[0], [*python[1:], "-u", *(["-m"] if plan.module else []), plan.script]) if wrapped \
        else (plan.script, [])
    args = torchrun.get_args_parser().parse_args([*argv, program])
    args.training_script_args = [*before, *worker_args(plan)]
    return args


def describe_failure(failures: list[Failure], each_rank_log: str | None = None, one_of_nodes: bool = False) -> str:
    """A short summary: the rank that failed first (whose traceback the user wants) and how the rest ended.

    The first is picked as on several nodes (see [Note: first failure]), not by torch's
    ``get_first_failure``: that goes by whole-second timestamps, so the rank the agent stopped with SIGTERM
    can be named instead of the one that died. Workers' stderr is not redirected (unless to per-rank logs),
    so a failing rank's own traceback is already on our stderr; the elastic agent's long report is not
    printed. A rank that ended without a traceback (killed, ``sys.exit``) is said to have none.
    """
    first = first_failure(failures)
    rest = "; ".join(f"rank {f.rank}: {f.how()}" for f in sorted(failures, key=lambda f: f.rank) if f is not first)
    where = f"in {os.path.join(each_rank_log, f'rank{first.rank}.log')}" if each_rank_log else "above"
    stopped = ("This node's ranks were stopped (each node's launcher stops only its own ranks)" if one_of_nodes
               else "The job was stopped")
    return (
        f"shardwise: rank {first.rank} (local rank {first.local_rank}, pid {first.pid}) failed first, with "
        f"{first.how()}{first.cause()}" + (f"; its traceback is {where}" if first.traceback else "")
        + f". {stopped}" + (f" (other ranks ended with {rest})." if rest else ".")
    )


def uses_own_agent(plan: LocalLaunch) -> bool:
    """A fixed world, no restarts, and this node's ranks known without a rendezvous: ``static_agent.py`` runs it
    (see [Note: own agent] there)."""
    known = plan.nnodes == "1" or (plan.first_rank is not None and plan.world_size is not None)
    return known and plan.rdzv_backend == "static" and plan.max_restarts == 0


def run_agent(plan: LocalLaunch) -> None:
    """Run this node's agent; raises :class:`RanksFailed` or :class:`AgentStopped` when the job did not succeed.

    Workers start through ``bootstrap.py`` and learn this process's pid, so that they stop themselves if it
    is killed (see [Note: orphaned ranks] in ``distributed/parent_watchdog.py``).
    """
    if plan.venv_script:
        os.environ.update(sourced_env(plan.venv_script))
    if plan.nproc > 1:
        # torchrun's own default for several workers (set here, where it also skips torchrun's banner).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[watchdog.AGENT_PID_VAR] = str(os.getpid())
    if plan.each_rank_log:
        os.environ[bootstrap.RANK_LOG_VAR] = os.path.abspath(plan.each_rank_log)
    if plan.pid_file:
        os.environ[bootstrap.PID_FILE_VAR] = plan.pid_file
        bootstrap.note_pid("agent")
    if plan.bind_cores:
        os.environ[affinity.BIND_VAR] = plan.bind_cores
    if uses_own_agent(plan):
        static_agent.run(static_job(in_bootstrap(plan)))
    else:
        _run_torch_agent(plan)


def static_job(plan: LocalLaunch) -> static_agent.Job:
    """The plan (already through :func:`in_bootstrap`) as ``static_agent`` runs it: ``python -u -m ...`` as torchrun."""
    signals = tuple(plan.agent_signals.split(",")) if plan.agent_signals else static_agent.DEFAULT_SIGNALS
    return static_agent.Job(nproc=plan.nproc, argv=("-u", "-m", plan.script, *worker_args(plan)),
                            master_addr=plan.master_addr, master_port=plan.master_port, port_chosen=plan.port_chosen,
                            run_id=plan.run_id, signals=signals, node_rank=plan.node_rank, nnodes=int(plan.nnodes),
                            first_rank=plan.first_rank or 0, world_size=plan.world_size)


def _run_torch_agent(plan: LocalLaunch) -> None:
    """torch's elastic agent, its errors turned into ours; a picked port that was taken before its store bound it
    is replaced (checking a port and binding it are two steps: two jobs started at once can both find it free)."""
    import torch.distributed as dist
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if plan.rdzv_backend == "c10d":
        # [Note: fresh store per round] By default the c10d agents share one TCPStore with their workers for
        # the whole job, so a restarted rank can read the gloo address its dead predecessor published and fail
        # to connect (or hang). Opting out makes rank 0 host a new store, on a new port, every round.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        try:
            torchrun.run(torchrun_args(in_bootstrap(plan)))
        except dist.DistNetworkError as error:
            if not (plan.port_chosen and plan.nnodes == "1" and "EADDRINUSE" in str(error)):
                raise
            port = free_port()
            static_agent.say_port_replaced(plan.master_port, port)
            torchrun.run(torchrun_args(in_bootstrap(replace(plan, master_port=port))))
    except ChildFailedError as error:
        raise RanksFailed(from_child_failed(error, host_name())) from None
    except SignalException as stop:
        raise AgentStopped(int(stop.sigval)) from None


def sourced_env(script: str) -> dict[str, str]:
    """The variables that sourcing ``script`` in bash sets or changes (e.g. a venv's ``bin/activate``)."""
    result = subprocess.run(["bash", "-c", '. "$1" >&2 && env -0', "bash", os.path.abspath(script)],
                            capture_output=True, timeout=120)
    if result.returncode != 0:
        said = result.stderr.decode(errors="replace").strip()[-500:]
        raise EnvFileError(f"--venv_script {script}: sourcing it in bash failed (exit {result.returncode})"
                           + (f": {said}" if said else "") + ". Fix the script, or leave --venv_script out.")
    pairs = (item.split("=", 1) for item in result.stdout.decode(errors="replace").split("\0") if "=" in item)
    return {k: v for k, v in pairs if k not in BASH_OWN_VARS and os.environ.get(k) != v}


def launch_local(plan: LocalLaunch) -> int:
    """Run the plan under its agent; return 0 on success, non-zero if any rank failed."""
    try:
        run_agent(plan)
    except RanksFailed as failed:
        print(describe_failure(failed.failures, plan.each_rank_log, one_of_nodes=plan.nnodes != "1"), file=sys.stderr,
              flush=True)
        return first_failure(failed.failures).exit_code()
    except AgentStopped as stop:  # Ctrl-C or a scheduler's SIGTERM: the agent has stopped the workers
        print(f"shardwise: stopped by {stop.name}; all ranks were stopped.", file=sys.stderr, flush=True)
        return 128 + stop.signum
    return 0


def pick_default_master_port(log_level: str = "info") -> int:
    """The default port 29500, or a free one (said on stderr) when something already listens there."""
    if port_is_free(DEFAULT_MASTER_PORT):
        return DEFAULT_MASTER_PORT
    port = free_port()
    say(f"master port {DEFAULT_MASTER_PORT} is in use on this machine; using free port {port} "
        "(pass --master_port to choose one).", "warning", log_level)
    return port
