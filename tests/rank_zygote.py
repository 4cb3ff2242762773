"""A pre-imported interpreter that forks the ranks the launcher starts, for the tests that launch training jobs.

A rank the launcher starts is a fresh `python -u -m shardwise.launcher.bootstrap ...`: ~3 CPU-s of importing torch
(and torch._dynamo at the optimizer's first step, transformers for the Hugging Face scripts) before ~0.5 s of
training. The launcher runs each rank through ``SHARDWISE_RANK_PYTHON`` when it is set; the tests that opt in set
it to this file's client (``python -I -S rank_zygote.py client``), which hands its standard streams (SCM_RIGHTS),
arguments, environment, working folder, affinity and umask to a server that imported the third-party packages
once (one server per pytest worker). The server forks a child that becomes the rank: own session, the client's
streams, a fresh `random` seed, the interpreter's exit (non-daemon threads joined, atexit run, streams flushed).
shardwise is never pre-imported: the code under test loads fresh in every rank, as in a new process.

The client stands in for the rank's process towards the launcher: the signals it gets go on to the child, and it
exits as the child did (a signal death is re-raised). When the client dies the server kills the child's session;
when the server's stdin closes (its pytest worker is gone) it kills every child and exits. Whatever the client
cannot hand over (no server, an interpreter option it does not emulate) it runs as the plain interpreter would:
it `exec`s `python` with the same arguments.

What a forked rank does not have, so that tests of these opt out: its own ``/proc/<pid>/cmdline``, the launcher as
its parent (its watchdog watches the server instead; the client's death stands in), and a kill of the rank's
process group or session reaching it (the launcher signals the client's pid, which forwards).
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import sys
import time

SOCKET_VAR = "SHARDWISE_TEST_RANK_ZYGOTE"  # the server's socket; read (and removed) by the client
RANK_PYTHON_VAR = "SHARDWISE_RANK_PYTHON"  # the launcher runs each rank's python through this command
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.utils.data", "numpy")
# For scripts that import Hugging Face's packages themselves (as tests/compat/zygote.py's scripts)
HF_PRELOAD = (*PRELOAD, "transformers", "transformers.trainer", "transformers.models.llama.modeling_llama", "peft",
              "accelerate", "datasets", "trl")
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGWINCH")
ORPHAN_POLL_S, ORPHAN_GRACE_S = 0.5, 3.0  # as distributed/parent_watchdog.py
_HEADER = struct.Struct("!Q")
_FDS = 3


_SERVERS: dict[tuple[str, ...], Server] = {}


def routing(preload: tuple[str, ...] = PRELOAD) -> dict[str, str]:
    """The variables that send a launch's ranks to this process's server for ``preload`` (started on first use,
    stopped at exit); none when SHARDWISE_TEST_ZYGOTE=0 (every rank a fresh interpreter)."""
    if os.environ.get("SHARDWISE_TEST_ZYGOTE", "1") == "0":
        return {}
    server = _SERVERS.get(preload)
    if server is None or not server.alive():
        if not _SERVERS:
            import atexit

            atexit.register(lambda: [s.close() for s in _SERVERS.values()])
        server = _SERVERS[preload] = Server(preload)
    return server.environ()


class Server:
    """One server (a pytest worker's), started with the worker's environment; ``environ()`` routes launches to it."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, timeout: float = 120.0) -> None:
        import subprocess
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="rank-zygote-")  # short: a socket's path has ~100 bytes at most
        self.path = os.path.join(self.folder, "socket")
        env = {k: v for k, v in os.environ.items() if k not in (SOCKET_VAR, RANK_PYTHON_VAR, "PYTEST_CURRENT_TEST")}
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", self.path, *preload],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready or self.process.stdout.readline() != "ready\n":
            self.close()
            raise RuntimeError(f"the rank zygote did not start (exit code {self.process.poll()})")

    def environ(self) -> dict[str, str]:
        import shlex

        client = shlex.join([sys.executable, "-I", "-S", os.path.abspath(__file__), "client"])
        return {RANK_PYTHON_VAR: client, SOCKET_VAR: self.path}

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        import shutil
        import subprocess

        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- the client ----
def client(args: list[str]) -> None:
    path = os.environ.pop(SOCKET_VAR, "")
    plan = _python_plan(args)
    conn = None
    if path and plan is not None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
        except OSError:
            conn.close()
            conn = None
    if conn is None:
        os.execv(sys.executable, [sys.executable, *args])
    request = json.dumps({"plan": plan, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(),
                          "affinity": sorted(os.sched_getaffinity(0))}).encode()
    conn.sendmsg([_HEADER.pack(len(request))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", range(_FDS)))])
    conn.sendall(request)
    parent, received = os.getppid(), bytearray()
    started = _line(conn, received, None)
    if not started:
        sys.stderr.write("rank_zygote: the server did not start the rank\n")
        sys.exit(1)
    pid = json.loads(started)["pid"]
    for name in FORWARDED:
        signal.signal(getattr(signal, name), lambda signum, _frame: _kill(pid, signum))
    orphaned_at = None
    while (line := _line(conn, received, ORPHAN_POLL_S)) is None:
        # The rank's watchdog watches the server; the launcher is this process's parent, so its death is seen
        # here and answered as the watchdog would (SIGTERM, then SIGKILL of the rank's session).
        if orphaned_at is None and os.getppid() != parent:
            orphaned_at = time.monotonic()
            _kill(pid, signal.SIGTERM)
        elif orphaned_at is not None and time.monotonic() - orphaned_at > ORPHAN_GRACE_S:
            _kill_session(pid)
    if not line:
        sys.stderr.write("rank_zygote: the server went away before the rank ended\n")
        sys.exit(1)
    code = json.loads(line)["code"]
    if code < 0:  # the rank died of a signal: so does its stand-in
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _line(conn: socket.socket, received: bytearray, timeout: float | None) -> bytes | None:
    """The next reply line; b"" when the server closed the connection, None when ``timeout`` passed first."""
    while b"\n" not in received:
        if not select.select([conn], [], [], timeout)[0]:
            return None
        chunk = conn.recv(4096)
        if not chunk:
            return b""
        received += chunk
    line, _, rest = bytes(received).partition(b"\n")
    received[:] = rest
    return line + b"\n"


def _python_plan(args: list[str]) -> dict | None:
    """What `python ARGS` would run, or None for an option the child does not emulate."""
    unbuffered = False
    for index, arg in enumerate(args):
        if arg == "-u":
            unbuffered = True
        elif arg == "-m" and index + 1 < len(args):
            return {"module": args[index + 1], "argv": args[index + 2:], "unbuffered": unbuffered}
        elif not arg.startswith("-"):
            return {"script": arg, "argv": args[index + 1:], "unbuffered": unbuffered}
        else:
            return None
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# ----------------------------------------------------------------------------------------------- the server ----
def serve(path: str, preload: list[str]) -> None:
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending: dict[socket.socket, int | None] = {}  # a client's connection -> the pid of its child
    children: dict[int, socket.socket | None] = {}  # None: its client is gone
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin, listener, wake_r, *pending], [], [], 1.0)
        if sys.stdin in ready and not sys.stdin.readline():
            for pid in children:
                _kill_session(pid)
            return
        if wake_r in ready:
            while _drain(wake_r):
                pass
        _reap(pending, children)
        if listener in ready:
            conn, _ = listener.accept()
            pending[conn] = None
        for conn in [c for c in ready if c in pending]:
            if pending[conn] is None:
                pid = _start(conn, own=[listener.fileno(), wake_r, wake_w, *(c.fileno() for c in pending)])
                if pid is None:
                    del pending[conn]
                    conn.close()
                    continue
                pending[conn] = pid
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            elif not conn.recv(1):  # the client is gone: so goes its rank
                pid = pending.pop(conn)
                children[pid] = None
                conn.close()
                _kill_session(pid)


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _reap(pending: dict, children: dict) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        try:
            conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass
        pending.pop(conn, None)
        conn.close()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _kill(pid, signal.SIGKILL)


def _start(conn: socket.socket, own: list[int]) -> int | None:
    """Reads one request and forks its rank; None when the request is cut short (the client died)."""
    fds = array.array("i")
    header, ancillary, _, _ = conn.recvmsg(_HEADER.size, socket.CMSG_SPACE(_FDS * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if len(header) < _HEADER.size or len(fds) != _FDS:
        for fd in fds:
            os.close(fd)
        return None
    size, = _HEADER.unpack(header)
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    if len(body) < size:
        for fd in fds:
            os.close(fd)
        return None
    request = json.loads(body)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _become_rank(request, list(fds), own, server=os.getppid())
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    return pid


def _become_rank(request: dict, fds: list[int], own: list[int], server: int) -> None:
    os.setsid()
    signal.set_wakeup_fd(-1)
    for name in ("SIGCHLD", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in own:
        try:
            os.close(fd)
        except OSError:
            pass
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    if env.get("SHARDWISE_AGENT_PID"):
        env["SHARDWISE_AGENT_PID"] = str(server)  # the parent-death watchdog watches the server, our parent
    _set_path(env)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["affinity"])
    _fresh_state(env)
    plan = request["plan"]
    sys.stdin = open(0, "r", closefd=False)  # noqa: SIM115 - the interpreter's own streams, never closed
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(write_through=plan["unbuffered"])
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.stderr.reconfigure(write_through=True)
    os._exit(_run(plan))


_BASE_PATH = list(sys.path[1:])
_BASE_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _set_path(env: dict[str, str]) -> None:
    """sys.path as `python` would build it under the rank's PYTHONPATH (entry 0 is set by _run)."""
    base = [p for p in _BASE_PATH if p not in {os.path.abspath(q) for q in _BASE_PYTHONPATH}]
    own = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ["", *own, *base]


def _fresh_state(env: dict[str, str]) -> None:
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _run(plan: dict) -> int:
    import atexit
    import runpy
    import threading

    code = 0
    try:
        if "module" in plan:
            sys.argv = [plan["module"], *plan["argv"]]
            sys.path[0] = os.getcwd()
            runpy.run_module(plan["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [plan["script"], *plan["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(plan["script"]))
            runpy.run_path(plan["script"], run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:  # what the interpreter does at exit
        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        client(sys.argv[2:])
    elif sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit("usage: rank_zygote.py client PYTHON-ARGS... | serve SOCKET [MODULE...]")
