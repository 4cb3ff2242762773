"""The first code every rank that ``shardwise`` starts runs, before the user's script (stdlib only).

``python -m shardwise.launcher.bootstrap [--pass-local-rank] {path|module|exec} TARGET [ARGS...]``

1. sends this rank's stdout/stderr to ``<dir>/rank<R>.log`` if ``--enable_each_rank_log`` asked for it;
2. notes its pid in the ``--save_pid`` file (``SHARDWISE_PID_FILE``);
3. starts the parent-death watchdog (``distributed/parent_watchdog.py``: no orphaned ranks after a SIGKILLed launcher);
4. under mpirun/srun (no ``RANK`` set), exports the torch variables found by ``distributed.env``, so
   scripts that call ``torch.distributed.init_process_group`` themselves work too;
5. with ``--bind_cores_to_rank``, pins this rank to its share of the node's cores (``affinity.py``);
6. runs the script as ``python script.py`` / ``python -m module`` would (``sys.argv``, ``sys.path[0]``,
   ``__main__``), with DeepSpeed's ``--local_rank=<r>`` first if asked, or ``exec``s an executable;
7. if the script raises, prints the traceback without this module's frames and writes it, with a precise
   time and the host, to the elastic agent's error file so the launcher can name the first failure; if it
   calls ``sys.exit`` with a failing code, the error file says where (Python prints no traceback for that).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from types import TracebackType

from shardwise.distributed import parent_watchdog as watchdog
from shardwise.error_file import HOST_VAR, host_name, write_error_file  # noqa: F401 - HOST_VAR: node.py sets it here
from shardwise.launcher import affinity

PID_FILE_VAR = "SHARDWISE_PID_FILE"
RANK_LOG_VAR = "SHARDWISE_EACH_RANK_LOG"
MODES = ("path", "module", "exec")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def _first(names: tuple[str, ...], default: str = "0") -> str:
    return next((os.environ[n] for n in names if os.environ.get(n)), default)


def redirect_output(log_dir: str) -> None:
    """Point fds 1 and 2 at ``<log_dir>/rank<R>.log`` (appending), as DeepSpeed's per-rank logs do."""
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, f"rank{_first(_RANK_VARS)}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


def note_pid(role: str) -> None:
    """Append ``<role> <host> <pid>`` to the ``--save_pid`` file, if one is in use (one write: atomic)."""
    path = os.environ.get(PID_FILE_VAR)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, f"{role} {host_name()} {os.getpid()}\n".encode())
        os.close(fd)


def export_scheduler_env() -> None:
    """Under mpirun/srun only the scheduler's variables exist; give the script torch's as well."""
    if "RANK" in os.environ:
        return
    from shardwise.distributed.env import discover

    discover().export()


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading frames of this module and of runpy: the user's traceback starts in their script."""
    first = tb
    while first is not None and _is_ours(first.tb_frame.f_code.co_filename):
        first = first.tb_next
    return first or tb


def _is_ours(filename: str) -> bool:
    return filename == __file__ or os.path.basename(filename) == "runpy.py" or filename == "<frozen runpy>"


def record_failure(error: BaseException) -> None:
    """Print the traceback and write it to the agent's error file."""
    tb = _script_frames(error.__traceback__)
    text = "".join(traceback.format_exception(type(error), error, tb))
    sys.stderr.write(text)
    sys.stderr.flush()
    write_error_file(f"{type(error).__name__}: {error}", text)


def record_exit(ending: SystemExit) -> None:
    """A failing ``sys.exit(code)``: Python prints no traceback, so note where it was called (no callstack)."""
    tb = ending.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
    write_error_file(f"sys.exit({ending.code!r}){where}", "")


def bind_cores() -> None:
    """``--bind_cores_to_rank``: pin this rank to its share of the node's cores (after the env is complete)."""
    setting = os.environ.get(affinity.BIND_VAR)
    if setting:
        affinity.bind_this_rank(setting, int(_first(("LOCAL_WORLD_SIZE",), "1")), int(_first(_LOCAL_RANK_VARS)))


def run_script(mode: str, target: str, args: list[str]) -> None:
    if mode == "exec":
        _set_parent_death_signal()
        os.execvp(target, [target, *args])
    if mode == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")


def _set_parent_death_signal() -> None:
    """An executable cannot run our watchdog thread; on Linux the kernel's parent-death signal stands in."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def parse(argv: list[str]) -> tuple[bool, str, str, list[str]]:
    pass_local_rank = bool(argv) and argv[0] == "--pass-local-rank"
    rest = argv[1:] if pass_local_rank else argv
    if len(rest) < 2 or rest[0] not in MODES:
        raise SystemExit(f"usage: python -m shardwise.launcher.bootstrap [--pass-local-rank] {{{'|'.join(MODES)}}} "
                         f"TARGET [ARGS...]; got {argv!r}")
    return pass_local_rank, rest[0], rest[1], rest[2:]


def main(argv: list[str]) -> None:
    pass_local_rank, mode, target, args = parse(argv)
    if os.environ.get(RANK_LOG_VAR):
        redirect_output(os.environ[RANK_LOG_VAR])
    note_pid(f"rank{_first(_RANK_VARS)}")
    watchdog.start_parent_watchdog()
    os.environ.pop(watchdog.AGENT_PID_VAR, None)  # the script's own children have this rank as parent
    export_scheduler_env()
    if pass_local_rank:
        args = [f"--local_rank={_first(_LOCAL_RANK_VARS)}", *args]
    try:
        bind_cores()
        run_script(mode, target, args)
    except SystemExit as ending:
        if not (ending.code is None or ending.code == 0):
            record_exit(ending)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then the rank exits 1
        record_failure(error)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
