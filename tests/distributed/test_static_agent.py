"""The one-node agent (launcher/static_agent.py): torchrun's environment without torch's agent, its master-port
claim, how it stops ranks, and that a launch imports no torch. Failure reports and port replacement are tested
end to end in test_launcher.py, which runs every one-node launch through this agent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from shardwise.launcher import static_agent
from shardwise.launcher.flags import LaunchError
from tests.distributed.test_launcher import child_env, free_port, run_command

try:
    import pytest_timeout  # noqa: F401

    pytestmark = [pytest.mark.timeout(180)]
except ImportError:
    pytestmark = []

DUMP_ENV = """import json, os, sys
with open(f"{sys.argv[1]}.{os.environ['RANK']}.json", "w") as f:
    json.dump(dict(os.environ), f)
"""
# Where the two agents differ by design: the port asked for, the error file's place, who hosts the store.
DIFFERENT_BY_DESIGN = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}


def test_ranks_get_the_environment_torchrun_gives(tmp_path: Path) -> None:
    script = tmp_path / "dump.py"
    script.write_text(DUMP_ENV)
    torchrun = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                            f"--master-port={free_port()}", str(script), str(tmp_path / "torchrun")], tmp_path)
    ours = run_command([sys.executable, "-m", "shardwise.cli", "--num_gpus", "2", "--no_local_rank",
                        f"--master_port={free_port()}", str(script), str(tmp_path / "ours")], tmp_path)
    assert torchrun.returncode == 0 and ours.returncode == 0, torchrun.stderr + ours.stderr
    for rank in (0, 1):
        theirs = json.loads((tmp_path / f"torchrun.{rank}.json").read_text())
        mine = json.loads((tmp_path / f"ours.{rank}.json").read_text())
        differ = {k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k) and k != "_"}  # bash's own
        assert differ == DIFFERENT_BY_DESIGN, {k: (theirs.get(k), mine.get(k)) for k in differ}
        assert (theirs["TORCHELASTIC_USE_AGENT_STORE"], mine["TORCHELASTIC_USE_AGENT_STORE"]) == ("True", "False")
        assert mine["RANK"] == str(rank) and mine["WORLD_SIZE"] == "2"  # not vacuous: the variables are there


NO_TORCH = """import sys
from shardwise.launcher.cli import run_launch
code = run_launch(sys.argv[1:], "shardwise")
assert "torch" not in sys.modules, "the launcher imported torch"
sys.exit(code)
"""


def test_a_one_node_launch_imports_no_torch_and_leaves_no_folder(tmp_path: Path) -> None:
    """~2 CPU-s of `import torch` per launch saved; torch's agent also left a /tmp/torchelastic_* folder per job."""
    script, scratch = tmp_path / "hello.py", tmp_path / "tmp"
    script.write_text("import os\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n")  # one write: -u
    scratch.mkdir()
    env = {**child_env(), "TMPDIR": str(scratch)}
    result = subprocess.run([sys.executable, "-c", NO_TORCH, "--num_gpus", "2", f"--master_port={free_port()}",
                             str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["rank 0", "rank 1"], result.stdout
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("platform", ["linux", "darwin"])  # an abstract Unix socket; a file lock elsewhere
def test_a_claimed_port_is_replaced_when_picked_and_refused_when_asked_for(
        platform: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the lock files' folder
    port = free_port()
    holder = static_agent.claim(port)
    assert holder is not None
    try:
        assert static_agent.claim(port) is None  # a second launcher here cannot claim it
        picked = static_agent.Job(nproc=1, argv=(), master_addr="127.0.0.1", master_port=port, port_chosen=True)
        other, other_holder = static_agent.claim_master_port(picked)
        other_holder.close()
        assert other != port
        assert f"master port {port} was taken between choosing it and starting the job" in capsys.readouterr().err
        asked = static_agent.Job(nproc=1, argv=(), master_addr="127.0.0.1", master_port=port, port_chosen=False)
        with pytest.raises(LaunchError, match=f"--master_port {port}: another job on this machine took the port"):
            static_agent.claim_master_port(asked)
    finally:
        holder.close()
    again = static_agent.claim(port)  # the claim ends with its holder (the kernel frees it when an agent dies)
    assert again is not None
    again.close()


STUBBORN = """import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + "." + os.environ["RANK"], "w").close()
time.sleep(600)
"""


def test_a_second_signal_stops_ranks_at_once_rather_than_after_the_grace(tmp_path: Path) -> None:
    """The first SIGTERM is passed on (these ranks ignore it); the second means now: SIGKILL, not 30 s later."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    agent = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "--num_gpus", "2", f"--master_port={free_port()}",
                              "--no_local_rank", str(script), str(tmp_path / "started")], cwd=tmp_path, env=child_env(),
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert time.monotonic() < deadline, "the ranks did not start"
        agent.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert agent.poll() is None, "the agent did not wait for the ranks it had asked to stop"
        sent = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=static_agent.STOP_GRACE_S / 2)
        assert time.monotonic() - sent < 5
    finally:
        if agent.poll() is None:
            agent.kill()
        stderr = agent.communicate()[1]
    assert code == 128 + signal.SIGTERM, stderr
    assert "shardwise: stopped by SIGTERM; all ranks were stopped." in stderr


def test_ranks_start_in_their_own_session(tmp_path: Path) -> None:
    """As under torch's agent: a terminal's Ctrl-C reaches the agent alone, which passes it on once."""
    script = tmp_path / "session.py"
    script.write_text(textwrap.dedent("""
        import os
        os.write(1, f"{os.environ['RANK']} {int(os.getsid(0) == os.getpid())}\\n".encode())
    """))
    result = run_command([sys.executable, "-m", "shardwise.cli", "--num_gpus", "2", f"--master_port={free_port()}",
                          str(script)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["0", "1", "1", "1"], result.stdout


def test_a_hostfile_node_gets_the_global_ranks_torchs_static_rendezvous_gives() -> None:
    """Uneven slots (3, 1, 2): each node's first rank is the sum of the slots before it, as torch's static
    rendezvous orders them by node rank; a node of an elastic job still goes to torch's agent."""
    from shardwise.launcher import local, node
    from shardwise.launcher.jobspec import Elastic, JobSpec

    spec = JobSpec(nodes=(("a", (0, 1, 2)), ("b", (0,)), ("c", (0, 1))), script="t.py", script_args=(), mode="path",
                   pass_local_rank=True, master_addr="a", master_port=29500, run_id="r")
    envs = []
    for node_rank in range(3):
        plan = node.agent_plan(spec, node_rank)
        assert local.uses_own_agent(plan)
        job = local.static_job(local.in_bootstrap(plan))
        envs += [static_agent.rank_env(job, local_rank, 29500, "e") for local_rank in range(plan.nproc)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3", "4", "5"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "0", "0", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "0", "1", "2", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["3", "3", "3", "1", "2", "2"]
    assert {(e["WORLD_SIZE"], e["ROLE_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in envs} == {("6", "6", "3")}
    elastic = JobSpec(**{**spec.__dict__, "elastic": Elastic(min_nodes=1, max_nodes=3, max_restarts=3)})
    assert not local.uses_own_agent(node.agent_plan(elastic, 1))


WRAPPER = """#!/bin/sh
echo "$RANK [$1] $2 $3 $4" >> {log}
shift
exec {python} "$@"
"""


@pytest.mark.parametrize("agent", ["own", "torch's (elastic)"])
def test_every_rank_runs_under_the_rank_python_command(tmp_path: Path, agent: str) -> None:
    """SHARDWISE_RANK_PYTHON (a profiler or numactl wrapper) stands in for `python` on both agents."""
    wrapper, log, script = tmp_path / "wrap", tmp_path / "wrapped.log", tmp_path / "hello.py"
    wrapper.write_text(WRAPPER.format(log=log, python=sys.executable))
    wrapper.chmod(0o755)
    script.write_text("import os\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n")
    env = {**child_env(), static_agent.RANK_PYTHON_VAR: f"{wrapper} 'its own arg'"}
    flags = [] if agent == "own" else ["--elastic_training"]
    result = subprocess.run([sys.executable, "-m", "shardwise.cli", "--num_gpus", "2", *flags,
                             f"--master_port={free_port()}", str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()[-2:]) == ["rank 0", "rank 1"], result.stdout
    assert sorted(log.read_text().splitlines()) == [f"{rank} [its own arg] -u -m shardwise.launcher.bootstrap"
                                                    for rank in (0, 1)]


@pytest.mark.parametrize(("setting", "message"), [
    ("no-such-wrapper-here python", "'no-such-wrapper-here' is not a program on PATH"),
    ("py-spy record -o 'rank.svg -- python", "cannot be split into a command line"),
])
def test_a_bad_rank_python_command_is_refused_before_any_rank_starts(tmp_path: Path, setting: str,
                                                                     message: str) -> None:
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    env = {**child_env(), static_agent.RANK_PYTHON_VAR: setting}
    result = subprocess.run([sys.executable, "-m", "shardwise.cli", "--num_gpus", "2", f"--master_port={free_port()}",
                             str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and message in result.stderr and "SHARDWISE_RANK_PYTHON" in result.stderr, result.stderr
    assert not (tmp_path / "ran").exists()
