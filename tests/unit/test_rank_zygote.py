"""The tests' rank zygote (tests/rank_zygote.py) must be indistinguishable from `python ARGS` to what the launcher
and a training script see: output, exit status, signals, environment, folder, import path; and nothing may outlive
its client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import rank_zygote
from tests.distributed.test_launcher import _alive  # a zombie counts as gone

pytestmark = pytest.mark.timeout(120)

PROBE = """import os, sys
print(sys.argv, __name__, os.getcwd(), os.environ.get("MARK"), "torch" in sys.modules, "shardwise" in sys.modules)
print(os.getppid() == int(os.environ["SERVER_PID"]), os.getsid(0) == os.getpid())
print("to stderr", file=sys.stderr)
import helper_module
print(helper_module.VALUE)
"""


@pytest.fixture(scope="module")
def server():
    running = rank_zygote.Server(preload=("torch",))
    yield running
    running.close()


def _client(server, args: list[str], cwd: Path, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    command = [sys.executable, "-I", "-S", rank_zygote.__file__, "client", *args]
    environ = {**os.environ, **(env or {}), rank_zygote.SOCKET_VAR: server.path, "SERVER_PID": str(server.process.pid)}
    return subprocess.Popen(command, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def _script(tmp_path: Path, source: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def test_a_script_sees_what_a_fresh_interpreter_would(server, tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_module.py").write_text("VALUE = 'from PYTHONPATH'\n")
    script = _script(tmp_path, PROBE)
    process = _client(server, ["-u", str(script), "a", "b"], tmp_path,
                      {"MARK": "set", "PYTHONPATH": str(tmp_path / "lib")})
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out.splitlines() == [f"['{script}', 'a', 'b'] __main__ {tmp_path} set True False", "True True",
                                "from PYTHONPATH"]
    assert err == "to stderr\n"


def test_a_module_runs_as_python_m_does(server, tmp_path: Path) -> None:
    (tmp_path / "runnable.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    process = _client(server, ["-m", "runnable", "x"], tmp_path)
    out, err = process.communicate(timeout=60)
    assert (process.returncode, out) == (0, f"__main__ ['x'] {tmp_path}\n"), err


@pytest.mark.parametrize(("source", "code", "stderr_has"), [
    ("import sys\nsys.exit(3)\n", 3, ""),
    ("import sys\nsys.exit('a message')\n", 1, "a message"),
    ("raise ValueError('broke')\n", 1, "ValueError: broke"),
    ("import atexit, sys\natexit.register(lambda: print('atexit ran', file=sys.stderr))\n", 0, "atexit ran"),
    ("import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()\n", 0, ""),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", -signal.SIGKILL, ""),
    ("raise KeyboardInterrupt\n", -signal.SIGINT, "KeyboardInterrupt"),
])
def test_the_exit_is_the_interpreters(server, tmp_path: Path, source: str, code: int, stderr_has: str) -> None:
    process = _client(server, [str(_script(tmp_path, source))], tmp_path)
    out, err = process.communicate(timeout=60)
    assert process.returncode == code, err
    assert stderr_has in err
    if "threading" in source:
        assert out == "joined\n"  # non-daemon threads are joined before the rank exits


def test_a_signal_to_the_client_reaches_the_rank(server, tmp_path: Path) -> None:
    source = ("import os, signal, sys, time\n"  # os.write: a print in the handler could land inside print's flush
              "signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b'got SIGTERM\\n'), sys.exit(5)))\n"
              "os.write(1, b'ready\\n')\ntime.sleep(60)\n")
    process = _client(server, ["-u", str(_script(tmp_path, source))], tmp_path)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert (process.returncode, out) == (5, "got SIGTERM\n"), err


def test_a_killed_client_takes_its_rank_and_the_ranks_children_with_it(server, tmp_path: Path) -> None:
    source = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(os.getpid(), child.pid, flush=True)\ntime.sleep(60)\n")
    process = _client(server, ["-u", str(_script(tmp_path, source))], tmp_path)
    pids = [int(word) for word in process.stdout.readline().split()]
    process.kill()
    process.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def test_a_rank_whose_launcher_died_stops_as_its_watchdog_would(server, tmp_path: Path) -> None:
    """The rank's own watchdog watches the server; the client, whose parent the launcher is, stands in."""
    script = _script(tmp_path, "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    client = [sys.executable, "-I", "-S", rank_zygote.__file__, "client", "-u", str(script)]
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                                 f"subprocess.Popen({client!r})\ntime.sleep(60)\n"], cwd=tmp_path,
                                env={**os.environ, rank_zygote.SOCKET_VAR: server.path}, stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
    rank = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 15
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


def test_without_a_server_the_client_runs_the_interpreter_itself(tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys\nprint('torch' in sys.modules, sys.flags.isolated, sys.flags.no_site)\n")
    env = {k: v for k, v in os.environ.items() if k != rank_zygote.SOCKET_VAR}
    result = subprocess.run([sys.executable, "-I", "-S", rank_zygote.__file__, "client", str(script)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "False 0 0\n"), result.stderr


def test_an_option_it_does_not_emulate_runs_the_interpreter_itself(server, tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys\nprint('torch' in sys.modules, sys.flags.optimize)\n")
    process = _client(server, ["-O", str(script)], tmp_path)
    out, err = process.communicate(timeout=60)
    assert (process.returncode, out) == (0, "False 1\n"), err

