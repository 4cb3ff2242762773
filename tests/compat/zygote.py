"""A pre-imported interpreter that forks the scripts of tests/compat instead of starting them from nothing.

A script run is ~1 s of training after ~8-10 s of importing torch, transformers, peft, trl (and, in .dsvenv,
DeepSpeed). The zygote imports those third-party packages once per interpreter per test session, then for each
run forks one child per rank that sets the run's environment, argv and working directory, and executes the script
as `__main__` with its output in files. shardwise and the compatibility package are never pre-imported: the code
under test loads fresh in every child, as in a new process. py-cpuinfo is asked once, in the zygote
(tests/reference.py: it starts an interpreter per question, and DeepSpeed asks in every rank). What a child does
at exit is what an interpreter does (join non-daemon threads, run atexit hooks, flush), then `os._exit`. Several
ranks are torchrun's environment without its agent: rank 0 hosts the rendezvous store; when one rank fails the
others are killed, as torchrun does.

Protocol over the server's stdin/stdout, one JSON line each way: {"script", "args", "cwd", "envs": [per rank],
"outputs": [[stdout, stderr] per rank]} -> {"pids": [...]} and, once every rank has exited, {"codes": [...]}.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

# Imported in the zygote before any fork. Only third-party code; a module missing from an interpreter is skipped.
PRELOAD = ("torch", "torch.distributed", "torch.utils.data", "transformers", "transformers.trainer",
           "transformers.models.llama.modeling_llama", "peft", "accelerate", "datasets", "trl", "deepspeed")


class ScriptTimeout(AssertionError):
    pass


class Zygote:
    """One pre-imported `python` whose forks run scripts; start it once and reuse it."""

    def __init__(self, python: str, env: dict[str, str], cwd: str, preload: tuple[str, ...] = PRELOAD) -> None:
        preload = [m for m in preload if m != "deepspeed" or _is_reference(python)]
        self.process = subprocess.Popen([python, "-c", SERVER, json.dumps(preload)], env=env, cwd=cwd,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, script: str, args: list[str], cwd: str, envs: list[dict[str, str]], outputs: list[tuple[str, str]],
            timeout: float) -> list[int]:
        request = {"script": script, "args": args, "cwd": cwd, "envs": envs, "outputs": outputs}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout
        pids = self._reply(deadline)["pids"]
        try:
            return self._reply(deadline)["codes"]
        except ScriptTimeout:
            for pid in pids:
                _kill(pid)
            self._reply(time.monotonic() + 30)
            raise

    def _reply(self, deadline: float) -> dict:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ScriptTimeout("the script did not finish in time")
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if ready:
                line = self.process.stdout.readline()
                if not line:
                    raise AssertionError(f"the zygote exited (code {self.process.wait()})")
                return json.loads(line)

    def close(self) -> None:
        if self.alive():
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _is_reference(python: str) -> bool:
    """The real DeepSpeed's interpreter; in this one `deepspeed` is shardwise's compatibility package."""
    return python != sys.executable


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


SERVER = r'''
import atexit, importlib, json, os, runpy, signal, sys, threading, traceback

for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
try:  # as tests/reference.py's serve_cpu_info_once, which the server cannot import (it may run outside the repo)
    import cpuinfo
    _CPU_INFO = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: dict(_CPU_INFO)
except ImportError:
    pass
sys.argv = [""]
BASE_PATH = list(sys.path[1:])


def child(request, rank):
    env, (out, err) = request["envs"][rank], request["outputs"][rank]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[:] = [os.path.dirname(os.path.abspath(script))] + BASE_PATH
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # what the interpreter does at exit: wait for non-daemon threads, run atexit hooks, flush
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def reap(pids):
    codes, left = {}, set(pids)
    while left:
        pid, status = os.wait()
        if pid not in left:
            continue
        left.discard(pid)
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:  # as torchrun: one failed rank stops the others
            for other in left:
                try:
                    os.kill(other, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    return [codes[p] for p in pids]


for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(len(request["envs"])):
        pid = os.fork()
        if pid == 0:
            child(request, rank)
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    print(json.dumps({"codes": reap(pids)}), flush=True)
'''
