"""Runner command lines built from a hostfile selection (pure), and picking the first failure."""

from __future__ import annotations

import shlex

import pytest

from shardwise.launcher import runners
from shardwise.launcher.failures import Failure, first_failure
from shardwise.launcher.jobspec import Elastic, JobSpec

SPEC = JobSpec(nodes=(("n1", (0, 1)), ("n2", (0, 1))), script="/w/train.py", script_args=("--msg", "a b; $(rm -rf /)", "'"),
               mode="path", pass_local_rank=True, master_addr="n1", master_port=29500, run_id="r1",
               elastic=Elastic(1, 2, 3))
ENV = {"PYTHONPATH": "/src:/x y", "NCCL_DEBUG": "INFO", "VIRTUAL_ENV": "/venv"}


def test_spec_round_trips_and_carries_args_as_one_word() -> None:
    word = SPEC.encode()
    assert JobSpec.decode(word) == SPEC
    assert shlex.split(word) == [word]  # base64: nothing for a shell to interpret


def test_ssh_commands_quote_everything_for_the_remote_shell() -> None:
    commands = runners.ssh_commands(SPEC, "/venv/bin/python", "/work dir", ENV, ["-F", "cfg"], ssh_port=2222)
    assert [c.node for c in commands] == [0, 1]
    argv = commands[1].argv
    assert argv[:12] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "ServerAliveInterval=10",
                         "-p", "2222", "-F", "cfg", "n2"]
    remote = shlex.split(argv[12])  # what the remote shell will see
    assert remote[:4] == ["cd", "/work dir", "&&", "exec"]
    assert "PYTHONPATH=/src:/x y" in remote and remote[-1] == "--node_rank=1"
    assert JobSpec.decode(remote[-2]).script_args == SPEC.script_args


def test_pdsh_finds_node_rank_by_host_name() -> None:
    (command,) = runners.pdsh_commands(SPEC, "/p", "/w", {}, ssh_port=2222)
    assert command.argv[:6] == ["pdsh", "-S", "-f", "2", "-w", "n1,n2"]
    assert command.argv[-1].endswith("--host=%h") and command.env["PDSH_RCMD_TYPE"] == "ssh"
    assert "-p 2222" in command.env["PDSH_SSH_ARGS_APPEND"]


def test_openmpi_exports_master_and_runs_the_bootstrap() -> None:
    (command,) = runners.openmpi_commands(SPEC, "/p", {"NCCL_DEBUG": "INFO"}, "/tmp/hf", as_root=True)
    argv = command.argv
    assert argv[:5] == ["mpirun", "-n", "4", "--hostfile", "/tmp/hf"] and "--allow-run-as-root" in argv
    assert "MASTER_ADDR=n1" in argv and "NCCL_DEBUG=INFO" in argv
    assert argv[argv.index("/p"):][:7] == ["/p", "-u", "-m", "shardwise.launcher.bootstrap", "--pass-local-rank",
                                          "path", "/w/train.py"]
    assert runners.openmpi_hostfile(SPEC) == "n1 slots=2\nn2 slots=2\n"


def test_slurm_and_mpich_need_the_same_count_on_every_node() -> None:
    uneven = JobSpec(**{**SPEC.__dict__, "nodes": (("n1", (0, 1)), ("n2", (0,)))})
    with pytest.raises(runners.RunnerError, match="same number of processes on every node; got n1: 2, n2: 1"):
        runners.slurm_commands(uneven, "/p", {})
    (srun,) = runners.slurm_commands(SPEC, "/p", {"A": "1"})
    assert srun.argv[:5] == ["srun", "-n", "4", "--ntasks-per-node=2", "--nodelist=n1,n2"]
    assert srun.env == {"A": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    (mpich,) = runners.mpich_commands(SPEC, "/p", {})
    assert mpich.argv[:7] == ["mpirun", "-n", "4", "-ppn", "2", "-hosts", "n1,n2"]


def test_slot_choice_needs_an_agent_runner() -> None:
    chosen = JobSpec(**{**SPEC.__dict__, "nodes": (("n1", (1,)),)})
    with pytest.raises(runners.RunnerError, match=r"cannot use particular slots \(n1: \[1\]\)"):
        runners.openmpi_commands(chosen, "/p", {}, "/hf")


def _failure(rank: int, exitcode: int, message: str = "", time: float = 0.0) -> Failure:
    return Failure(rank, rank % 2, f"h{rank // 2}", 100 + rank, exitcode, message, "", time)


def test_first_failure_is_the_cause_not_its_consequences() -> None:
    peer = "CollectiveError: [rank 0/4] Connection closed by peer [10.0.0.2]:6819"
    failures = [_failure(0, 1, peer, time=1.0), _failure(1, 1, peer, time=1.0), _failure(3, -9, time=2.0)]
    first = first_failure(failures)
    assert first.rank == 3 and first.summary() == (
        "rank 3 on host h1 (local rank 1, pid 103) failed first, with signal 9 (SIGKILL): it was killed, so there "
        "is no Python traceback")
    assert first_failure([_failure(2, 1, "ValueError: x", 5.0), _failure(0, 1, "KeyError: y", 4.0)]).rank == 0


def test_one_node_summary_names_the_killed_rank_not_the_one_the_agent_stopped() -> None:
    from shardwise.launcher.local import describe_failure

    # The agent's SIGTERM to the survivor can carry an earlier (whole-second) time than the SIGKILL it answers.
    stopped, killed = _failure(0, -15, time=10.0), _failure(1, -9, time=11.0)
    assert describe_failure([stopped, killed]) == (
        "shardwise: rank 1 (local rank 1, pid 101) failed first, with signal 9 (SIGKILL): it was killed, so there is "
        "no Python traceback. The job was stopped (other ranks ended with rank 0: signal 15 (SIGTERM)).")
    assert first_failure([stopped, killed]).exit_code() == 1


@pytest.mark.parametrize(("failure", "log_dir", "one_of_nodes", "said"), [
    # A rank that called sys.exit(3): bootstrap.py noted where; Python printed no traceback.
    (Failure(1, 1, "h", 7, 3, "sys.exit(3) at /w/t.py:4", "", 0.0), None, False,
     "rank 1 (local rank 1, pid 7) failed first, with exit code 3 from sys.exit(3) at /w/t.py:4; there is no "
     "Python traceback. The job was stopped."),
    (Failure(1, 1, "h", 7, 3, "", "", 0.0), None, True,
     "rank 1 (local rank 1, pid 7) failed first, with exit code 3, without a Python traceback (os._exit, a crash in "
     "native code, or not a Python program). This node's ranks were stopped (each node's launcher stops only its "
     "own ranks)."),
    (Failure(1, 1, "h", 7, 1, "RuntimeError: boom", "Traceback ...\nRuntimeError: boom", 0.0), "/logs", False,
     "rank 1 (local rank 1, pid 7) failed first, with exit code 1: RuntimeError: boom; its traceback is in "
     "/logs/rank1.log. The job was stopped."),
])
def test_failure_summary_says_whether_there_is_a_traceback_and_where(failure: Failure, log_dir: str | None,
                                                                     one_of_nodes: bool, said: str) -> None:
    from shardwise.launcher.local import describe_failure

    assert describe_failure([failure], log_dir, one_of_nodes) == f"shardwise: {said}"
    assert failure.exit_code() == failure.exitcode


def test_sys_exit_in_a_rank_is_recorded_with_where_it_was_called(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import sys

    from shardwise.launcher import bootstrap

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    try:
        line = sys._getframe().f_lineno + 1
        sys.exit(3)
    except SystemExit as ending:
        bootstrap.record_exit(ending)
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]
    assert recorded["message"] == f"sys.exit(3) at {__file__}:{line}"
    assert recorded["extraInfo"]["py_callstack"] == ""


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from shardwise.cli import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("hostfile", "extra", "message"),
    [("n1 slots=2\nn1 slots=2\n", [], "line 2 ('n1 slots=2'): host 'n1' is listed twice"),
     ("n1 slots=2\nn2 slots=2\n", ["--include", "n3"], "--include: host 'n3' is not in the hostfile (hosts: n1, n2)."),
     ("n1 slots=2\nn2 slots=1\n", ["--launcher", "mpich"], "same number of processes on every node; got n1: 2, n2: 1")],
)
def test_launch_errors_from_the_command_line(hostfile: str, extra: list[str], message: str, tmp_path,
                                             capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.launcher import multinode

    monkeypatch.setattr(multinode, "require_tool", lambda runner: None)  # the plan fails before anything starts
    monkeypatch.setattr(multinode.subprocess, "Popen", None)
    (tmp_path / "hf").write_text(hostfile)
    (tmp_path / "train.py").write_text("")
    code, err = _main(["--hostfile", str(tmp_path / "hf"), *extra, str(tmp_path / "train.py")], capsys)
    assert code == 2 and message in err, err
