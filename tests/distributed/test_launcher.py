"""The ``shardwise`` launcher end to end: real worker processes on CPU with gloo, plus its pure helpers.

Each launch starts a launcher and its workers as subprocesses with a hard timeout, so a hang fails the
test instead of stalling the suite. Worker scripts use only ``torch.distributed``: the launcher must work
for any script, and the same script must also run under ``torchrun`` and as plain ``python script.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:  # a hard per-test limit where pytest-timeout is installed; subprocess timeouts apply regardless
    import pytest_timeout  # noqa: F401

    pytestmark = [pytest.mark.timeout(180)]
except ImportError:
    pytestmark = []

SRC = Path(__file__).resolve().parents[2] / "src"
LAUNCH_TIMEOUT_S = 120  # generous: two cores, each process imports torch
FAILURE_TIMEOUT_S = 60  # rank 0 sleeps for 600 s, so finishing at all means it was stopped

WORKER = textwrap.dedent(
    '''
    """Launcher test worker: one gloo all_reduce, then a JSON line saying what this rank was given."""
    import argparse, json, os, socket, sys
    import torch
    import torch.distributed as dist


    def set_env_defaults():  # plain `python script.py`: no launcher set these, so run as a world of one
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    args, _ = parser.parse_known_args()
    set_env_defaults()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    try:  # the CPUs this rank may run on, as the kernel says (for --bind_cores_to_rank)
        with open("/proc/self/status") as f:
            cpus = next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
    except OSError:
        cpus = None
    report = {
        "rank": rank, "world": world, "local_rank_env": int(os.environ["LOCAL_RANK"]),
        "local_rank_arg": args.local_rank, "argv": sys.argv[1:], "sum": total.item(), "cpus": cpus,
        "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "SHARDWISE_TEST_VENV")},
    }
    os.write(1, (json.dumps(report) + "\\n").encode())  # one write: ranks share the pipe, run with -u
    dist.destroy_process_group()
    '''
)

FAILING_WORKER = textwrap.dedent(
    '''
    """Launcher test worker: rank 1 raises after init while rank 0 sleeps far longer than the test waits."""
    import os, sys, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        with open(sys.argv[-1], "w") as f:
            f.write(str(os.getpid()))
    dist.barrier()  # rank 0's pid is on disk before rank 1 fails
    if dist.get_rank() == 1:
        raise RuntimeError("boom from rank 1")
    time.sleep(600)
    '''
)

EXITING_WORKER = textwrap.dedent(
    '''
    """Launcher test worker: collectives on temporaries right before the interpreter exits. Under plain
    torch 2.13 about one rank in four then aborts with SIGABRT (gloo drops the last work during finalization)."""
    import torch
    import torch.distributed as dist
    import shardwise

    shardwise.init_distributed(dist_backend="gloo", verbose=False)
    for _ in range(20):
        dist.all_reduce(torch.ones(1))
    '''
)

LAUNCHER_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def child_env() -> dict[str, str]:
    """This environment minus any launcher variables, with one thread per process and our sources first."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_KEYS and not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    return env


def run_command(cmd: list[str], cwd: Path, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout)


def run_shardwise(args: list[str], cwd: Path, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    if not any(a.startswith("--master_port") for a in args):
        # Two tests launching at once (pytest's two workers) would both find the default port 29500 free and one
        # would fail to bind it; the default's own choice is tested in test_busy_default_port_is_replaced_and_said.
        args = [f"--master_port={free_port()}", *args]
    return run_command([sys.executable, "-m", "shardwise.cli", *args], cwd, timeout)


def reports(result: subprocess.CompletedProcess[str]) -> list[dict]:
    """The workers' JSON lines, sorted by rank; fails with both streams shown if the run failed."""
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return sorted(lines, key=lambda r: r["rank"])


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_two_processes_get_ranks_local_rank_and_args(worker: Path) -> None:
    result = run_shardwise(["--num_gpus", "2", str(worker), "--foo", "a b", "--num_gpus", "7"], worker.parent)
    got = reports(result)
    assert [r["rank"] for r in got] == [0, 1]
    for r in got:
        assert r["world"] == 2 and r["sum"] == 3.0
        assert r["local_rank_arg"] == r["local_rank_env"] == r["rank"]
        # --local_rank first (as DeepSpeed's launcher does), then the script's args untouched, spaces included
        assert r["argv"] == [f"--local_rank={r['rank']}", "--foo", "a b", "--num_gpus", "7"]


def test_no_local_rank_leaves_args_alone(worker: Path) -> None:
    got = reports(run_shardwise(["--num_gpus", "2", "--no_local_rank", str(worker), "--foo", "x"], worker.parent))
    assert [(r["rank"], r["world"], r["sum"]) for r in got] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert all(r["argv"] == ["--foo", "x"] and r["local_rank_arg"] is None for r in got)
    assert [r["local_rank_env"] for r in got] == [0, 1]


def test_module_mode_runs_a_module_by_name(worker: Path) -> None:
    got = reports(run_shardwise(["--num_gpus", "1", "--module", "worker", "--bar"], worker.parent))
    assert [(r["rank"], r["world"], r["sum"], r["argv"]) for r in got] == [(0, 1, 1.0, ["--local_rank=0", "--bar"])]


def test_same_script_runs_under_torchrun(worker: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker), "--foo", "a b"]
    got = reports(run_command(cmd, worker.parent))
    assert [(r["rank"], r["world"], r["sum"], r["local_rank_env"]) for r in got] == [(0, 2, 3.0, 0), (1, 2, 3.0, 1)]
    assert all(r["argv"] == ["--foo", "a b"] for r in got)


def test_same_script_runs_as_plain_python(worker: Path) -> None:
    got = reports(run_command([sys.executable, str(worker), "--foo", "a b"], worker.parent))
    assert [(r["rank"], r["world"], r["sum"], r["argv"]) for r in got] == [(0, 1, 1.0, ["--foo", "a b"])]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_failing_rank_stops_the_job_and_shows_its_traceback(tmp_path: Path) -> None:
    script, pid_file = tmp_path / "fails.py", tmp_path / "rank0.pid"
    script.write_text(FAILING_WORKER)
    result = run_shardwise(["--num_gpus", "2", str(script), str(pid_file)], tmp_path, timeout=FAILURE_TIMEOUT_S)
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr, result.stderr
    assert 'raise RuntimeError("boom from rank 1")' in result.stderr, result.stderr
    assert "RuntimeError: boom from rank 1" in result.stderr, result.stderr
    assert "shardwise: rank 1 (local rank 1" in result.stderr, result.stderr
    assert "failed first, with exit code 1: RuntimeError: boom from rank 1; its traceback is above." in result.stderr
    assert not _alive(int(pid_file.read_text())), "rank 0 is still running after the launcher exited"


SYS_EXIT_WORKER = """import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(600)
"""


def test_rank_that_calls_sys_exit_is_reported_with_its_code_not_a_traceback(tmp_path: Path) -> None:
    script = tmp_path / "exits3.py"
    script.write_text(SYS_EXIT_WORKER)
    result = run_shardwise(["--num_gpus", "2", str(script)], tmp_path, timeout=FAILURE_TIMEOUT_S)
    assert result.returncode == 3, result.stderr
    assert (f"failed first, with exit code 3 from sys.exit(3) at {script}:3; there is no Python traceback. "
            "The job was stopped") in result.stderr, result.stderr
    assert "traceback is above" not in result.stderr and "Traceback" not in result.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def test_deepspeed_style_one_host_hostfile_command_runs_here(worker: Path) -> None:
    hostfile, venv = worker.parent / "hostfile", worker.parent / "activate"
    hostfile.write_text("localhost slots=2\n")
    venv.write_text("export SHARDWISE_TEST_VENV=sourced\n")
    port = free_port()
    result = run_shardwise(["-H", str(hostfile), "--master_addr", "127.0.0.1", f"--master_port={port}",
                            "--venv_script", str(venv), str(worker), "--x"], worker.parent)
    got = reports(result)
    assert [(r["rank"], r["world"], r["sum"], r["argv"]) for r in got] == [
        (0, 2, 3.0, ["--local_rank=0", "--x"]), (1, 2, 3.0, ["--local_rank=1", "--x"])]
    assert all(r["env"]["MASTER_ADDR"] == "127.0.0.1" and r["env"]["MASTER_PORT"] == str(port) for r in got)
    assert all(r["env"]["SHARDWISE_TEST_VENV"] == "sourced" for r in got)  # --venv_script was sourced
    assert "not this machine" not in result.stderr


def _cpu_set(text: str) -> list[int]:
    from shardwise.launcher.affinity import parse_core_list

    return parse_core_list(text)


def test_bind_cores_to_rank_pins_each_rank_to_its_own_cores(worker: Path) -> None:
    from shardwise.launcher.affinity import one_per_physical_core

    allowed = os.sched_getaffinity(0)
    if len(one_per_physical_core(allowed)) < 2:
        pytest.skip("needs two physical cores to give two ranks one each")
    got = reports(run_shardwise(["--num_gpus", "2", "--bind_cores_to_rank", str(worker)], worker.parent))
    first, second = (_cpu_set(r["cpus"]) for r in got)
    assert len(first) == len(second) >= 1 and max(first) < min(second)  # equal, consecutive, disjoint shares
    assert set(first + second) <= allowed
    assert [r["env"]["OMP_NUM_THREADS"] for r in got] == [str(len(first))] * 2
    last = max(allowed)
    (only,) = reports(run_shardwise(["--num_gpus", "1", "--bind_cores_to_rank", f"--bind_core_list={last}",
                                     str(worker)], worker.parent))
    assert (only["cpus"], only["env"]["OMP_NUM_THREADS"]) == (str(last), "1")


def test_ranks_exit_cleanly_right_after_collectives(tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text(EXITING_WORKER)
    for _ in range(3):  # without shardwise's exit hook, three 4-rank launches all succeed ~3% of the time
        result = run_shardwise(["--num_gpus", "4", str(script)], tmp_path)
        assert result.returncode == 0, f"exit {result.returncode}\nstderr:\n{result.stderr[-4000:]}"


# --- argument errors: checked before any process starts, so main() is called in-process ---


def shardwise_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from shardwise.cli import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--num_nodes", "2"], "--num_nodes 2: several nodes need a --hostfile listing them"),
     (["--hostfile", "no_such_hosts.txt"], "--hostfile no_such_hosts.txt: no such file")],
)
def test_multi_node_request_without_hosts_is_refused_clearly(
    args: list[str], message: str, worker: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = shardwise_main([*args, str(worker)], capsys)
    assert code == 2 and out == ""
    assert message in err


def test_missing_script_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = shardwise_main(["--num_gpus", "2", str(tmp_path / "no_such_script.py"), "--x"], capsys)
    assert code == 2
    assert "no_such_script.py': no such file" in err
    assert "--module" in err  # the fix for users who meant a module


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "no script given"), (["--num_gpus", "0", "x.py"], "--num_gpus must be at least 1 (or -1 for all); got 0.")],
)
def test_bad_launch_arguments_are_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = shardwise_main(args, capsys)
    assert code == 2 and message in err


# --- pure helpers: no worker processes ---


def test_torchrun_invocation_keeps_script_args_out_of_torchrun_options() -> None:
    from shardwise.launcher.local import LocalLaunch, torchrun_args

    plan = LocalLaunch(nproc=3, script="train.py", script_args=("--nproc-per-node", "9"), master_port=1234)
    args = torchrun_args(plan)
    assert (args.nproc_per_node, args.nnodes, args.max_restarts, args.master_port) == ("3", "1", 0, 1234)
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--local_rank=${local_rank}", "--nproc-per-node", "9"]
    assert torchrun_args(LocalLaunch(nproc=1, script="m", module=True, pass_local_rank=False)).module


def test_busy_default_port_is_replaced_and_said(capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.launcher import local

    with socket.socket() as holder:
        try:  # SO_REUSEADDR: a connection of another test's in TIME_WAIT on the port must not fail the bind
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("", local.DEFAULT_MASTER_PORT))
            holder.listen()
        except OSError:
            pass  # something else already holds it: just as busy
        port = local.pick_default_master_port()
    assert port != local.DEFAULT_MASTER_PORT
    assert f"master port {local.DEFAULT_MASTER_PORT} is in use" in capsys.readouterr().err


def test_busy_explicit_port_is_an_error() -> None:
    from shardwise.launcher.cli import LaunchError, resolve_master_port

    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        with pytest.raises(LaunchError, match=f"--master_port {busy}: the port is in use"):
            resolve_master_port(busy)


def test_known_subcommand_is_dispatched_not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise import cli

    seen: list[list[str]] = []
    fake = cli.Subcommand("test tool", lambda argv: seen.append(argv) or 7)
    monkeypatch.setitem(cli.SUBCOMMANDS, "report", fake)
    assert cli.main(["report", "--json"]) == 7
    assert seen == [["--json"]]


REBIND = """
import sys
from shardwise.launcher import local
plan = local.LocalLaunch(nproc=2, script=sys.argv[1], master_port=int(sys.argv[2]), port_chosen=True)
sys.exit(local.launch_local(plan))
"""


def test_a_picked_port_taken_before_the_bind_is_replaced(worker: Path) -> None:
    """The launcher checks its default port, then the agent binds it: another job may take it in between (two
    tests at once did). A port the launcher picked is then replaced; one the user asked for never is."""
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        result = run_command([sys.executable, "-c", REBIND, str(worker), str(taken)], worker.parent, LAUNCH_TIMEOUT_S)
        assert f"master port {taken} was taken between choosing it and starting the job; using free port" in result.stderr
        assert [r["rank"] for r in reports(result)] == [0, 1]
        asked = run_shardwise(["--num_gpus", "2", f"--master_port={taken}", str(worker)], worker.parent)
    assert asked.returncode != 0 and f"--master_port {taken}: the port is in use" in asked.stderr, asked.stderr
