"""DeepSpeed's launcher flags on the ``shardwise`` command line (parsing and planning only: nothing is started).

The list of DeepSpeed 0.19.8's flags is data (``tests/data/deepspeed_0_19_8_launcher_flags.json``, written
from DeepSpeed's own parser by ``tools/extract_deepspeed_launcher_flags.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardwise import cli
from shardwise.launcher import local
from shardwise.launcher.cli import plan_launch
from shardwise.launcher.flags import build_launch_parser, parse_launch_args

DS_FLAGS = json.loads((Path(__file__).parents[1] / "data" / "deepspeed_0_19_8_launcher_flags.json").read_text())
# A value each valued flag accepts, and what the parsed option then holds (default: the text, or int(text)).
SAMPLES = {"launcher": ("OpenMPI", "openmpi"), "bind_core_list": ("0-1", "0-1"), "log_level": ("Warning", "warning")}
# DeepSpeed defaults that shardwise does not treat as "not given", on purpose (see docs/guides/launching.md).
DEFAULT_DIFFERS = {
    "hostfile": "an explicit hostfile that does not exist is an error; DeepSpeed warns and runs locally",
    "master_port": "an explicit port must be free; left out, a free one replaces a busy 29500",
    "autotuning": "DeepSpeed's default '' is not one of its choices, so it cannot be given",
}


def _ids(flag: dict) -> str:
    return flag["option_strings"][-1]


def _sample(flag: dict) -> tuple[str, object]:
    if flag["dest"] in SAMPLES:
        return SAMPLES[flag["dest"]]
    if flag["choices"]:
        return flag["choices"][-1], flag["choices"][-1]
    return ("3", 3) if flag["type"] == "int" else ("some/value", "some/value")


@pytest.mark.parametrize("flag", DS_FLAGS["flags"], ids=_ids)
def test_every_deepspeed_flag_parses_in_each_spelling(flag: dict) -> None:
    ours = {option: action for action in build_launch_parser()._actions for option in action.option_strings}
    for option in flag["option_strings"]:
        action = ours[option]
        assert set(flag["option_strings"]) <= set(action.option_strings)  # DeepSpeed's aliases are one flag here too
        assert action.help and "%" not in action.help.replace("%%", "")
        if not flag["takes_value"]:
            args = parse_launch_args([option, "train.py", "--x"])
            assert getattr(args, action.dest) is True and args.command == ["train.py", "--x"]
            continue
        text, expected = _sample(flag)
        glued = [f"{option}{text}"] if not option.startswith("--") else []  # -Hfile
        for argv in ([option, text], [f"{option}={text}"], glued):
            if argv:
                args = parse_launch_args([*argv, "train.py", "--x"])
                assert getattr(args, action.dest) == expected, argv
                assert args.command == ["train.py", "--x"]


SPELLED_DEFAULTS = [f for f in DS_FLAGS["flags"]
                    if f["takes_value"] and f["default"] is not None and f["dest"] not in DEFAULT_DIFFERS]


@pytest.mark.parametrize("flag", SPELLED_DEFAULTS, ids=_ids)
def test_deepspeed_default_spelled_out_means_the_flag_was_left_out(flag: dict) -> None:
    given = parse_launch_args([f"{flag['option_strings'][-1]}={flag['default']}", "train.py"])
    assert vars(given) == vars(parse_launch_args(["train.py"]))


def test_the_list_of_flags_is_deepspeeds_and_complete() -> None:
    assert DS_FLAGS["deepspeed_version"] == "0.19.8" and DS_FLAGS["positionals"] == ["user_script", "user_args"]
    assert len(DS_FLAGS["flags"]) == 25  # a regenerated list with more flags needs a look at each new one


@pytest.mark.parametrize(("argv", "dest", "value"), [
    (["--elastic_training"], "elastic_training", True),  # older DeepSpeed releases' spellings
    (["--min_elastic_nodes=2"], "min_nodes", 2),
    (["--max_elastic_nodes", "3"], "max_nodes", 3),
    (["--comment", "run 7"], "comment", "run 7"),
    (["--account=proj"], "account", "proj"),
    (["--num_gpu", "2"], "num_gpus", 2),  # unique prefixes, as DeepSpeed's argparse takes them
    (["-q"], "log_level", "error"),
])
def test_older_spellings_and_prefixes(argv: list[str], dest: str, value: object) -> None:
    assert getattr(parse_launch_args([*argv, "train.py"]), dest) == value


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "two_hosts").write_text("n1 slots=2\nn2 slots=2\n")
    return tmp_path / "train.py"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str], entry=cli.main) -> tuple[int, str]:
    code = entry(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--autotuning", "tune"], "autotuning: the script's arguments name no DeepSpeed config (--deepspeed_config PATH"),
    (["--node_rank", "1"], "--node_rank 1: used only with --no_ssh"),
    (["--bind_core_list", "0"], "--bind_core_list 0: only used with --bind_cores_to_rank"),
    (["--bind_cores_to_rank", "--bind_core_list", "3-1"], "--bind_core_list '3-1': item '3-1' is out of order or overlaps"),
    (["--module", "--no_python"], "--module and --no_python cannot be used together"),
    (["--num_nodes", "0"], "--num_nodes must be at least 1 (or -1 for all); got 0."),
    (["--no_ssh", "--node_rank", "1"], "--no_ssh needs --node_rank between 0 and 0"),
    (["-H", "two_hosts", "--launcher", "IMPI"], "--launcher impi: not supported by shardwise; use --launcher mpich"),
    (["-H", "two_hosts", "--launcher", "openmpi", "--venv_script", "train.py"],
     "--venv_script: only the ssh and pdsh runners source it on the nodes; got --launcher openmpi"),
    (["-H", "two_hosts", "--launcher", "slurm", "--ssh_port", "2222"],
     "--ssh_port 2222: --launcher slurm does not take it"),
    (["-H", "two_hosts", "--no_ssh", "--node_rank", "0", "--launcher", "slurm"],
     "--no_ssh starts this node's ranks here; --launcher slurm would start every node's from one place"),
    (["--enable_each_rank_log", "train.py"], "--enable_each_rank_log train.py: is a file; give a directory."),
])
def test_what_shardwise_cannot_honour_is_refused_by_name(argv: list[str], message: str, script: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run([*argv, str(script)], capsys)
    assert code == 2 and f"shardwise: error: {message}" in err, err


def test_too_few_cores_to_bind_every_rank_is_refused(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    core = min(os.sched_getaffinity(0))
    code, err = _run(["--num_gpus", "2", "--bind_cores_to_rank", f"--bind_core_list={core}", str(script)], capsys)
    assert code == 2 and f"--bind_cores_to_rank: 1 core(s) ({core}) for 2 ranks on this node" in err, err


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[local.LocalLaunch]:
    """Local plans handed to the elastic agent; nothing is started."""
    plans: list[local.LocalLaunch] = []
    monkeypatch.setattr(local, "launch_local", lambda plan: plans.append(plan) or 0)
    return plans


def test_one_host_hostfile_naming_an_unknown_host_is_refused(script: Path, capsys: pytest.CaptureFixture[str],
                                                             started: list) -> None:
    Path("hf").write_text("no-such-host.invalid slots=2\n")
    code, err = _run(["-H", "hf", str(script)], capsys)
    assert code == 2 and started == []
    assert ("--hostfile hf: its only host 'no-such-host.invalid' does not resolve here. A one-host hostfile runs on "
            "this machine") in err, err


@pytest.mark.parametrize(("host", "quiet", "noted"), [("192.0.2.7", False, True), ("192.0.2.7", True, False),
                                                      ("localhost", False, False)])
def test_one_host_hostfile_runs_here_and_says_so_when_the_host_is_elsewhere(
        host: str, quiet: bool, noted: bool, script: Path, capsys: pytest.CaptureFixture[str], started: list) -> None:
    Path("hf").write_text(f"{host} slots=2\n")
    code, err = _run(["-H", "hf", *(["-q"] if quiet else []), str(script)], capsys)
    assert code == 0 and [p.nproc for p in started] == [2]
    note = f"the hostfile hf names one host, {host}, which is not this machine"
    assert (note in err) == noted, err
    if noted:
        assert "running its 2 slot(s) here, as DeepSpeed does. Pass --force_multi to run on 192.0.2.7" in err


def test_no_ssh_starts_only_this_nodes_agent(script: Path, started: list, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.launcher import bootstrap

    for var in (bootstrap.HOST_VAR, "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES"):  # the node's plan sets them
        monkeypatch.setenv(var, "")  # so that the test's end restores them: a delenv of an absent one records nothing
        monkeypatch.delenv(var)
    assert cli.main(["--hostfile=two_hosts", "--no_ssh", "--node_rank=1", "--master_addr=127.0.0.1",
                     "--master_port=29999", str(script), "--lr", "1"]) == 0
    (plan,) = started
    assert (plan.nnodes, plan.node_rank, plan.nproc, plan.rdzv_backend) == ("2", 1, 2, "static")
    assert (plan.master_addr, plan.master_port, plan.local_addr) == ("127.0.0.1", 29999, "n2")
    assert plan.script == str(script) and plan.script_args == ("--lr", "1")
    assert os.environ[bootstrap.HOST_VAR] == "n2"


def test_runner_options_reach_the_runner_commands(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.launcher import multinode, runners

    plan = plan_launch(parse_launch_args(["-H", "two_hosts", "--launcher", "slurm", "--comment", "c 1",
                                              "--account=acct", "--bind_cores_to_rank", str(script)]))
    (srun,) = multinode.scheduler_commands(plan, "/unused")
    assert "--comment=c 1" in srun.argv and "--account=acct" in srun.argv
    assert srun.env["SHARDWISE_BIND_CORES"] == "all"
    spec = plan.spec
    (mpirun,) = runners.openmpi_commands(spec, "/p", {}, "/hf", ssh_port=2222)
    assert mpirun.argv[mpirun.argv.index("plm_rsh_args") + 1] == "-p 2222"
    remote = runners.ssh_commands(spec, "/p", "/w", {}, venv_script="/v/bin/activate")[0].argv[-1].split()
    assert remote[3:7] == [".", "/v/bin/activate", "&&", "exec"]  # sourced on the node, before the agent starts


@pytest.mark.parametrize(("level", "noted"), [([], True), (["--log_level", "warning"], False)])
def test_slurm_only_tags_are_noted_when_dropped(level: list[str], noted: bool, script: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    plan_launch(parse_launch_args(["-H", "two_hosts", "--launcher", "ssh", "--account", "a", *level, str(script)]))
    assert ("--account is passed on only by --launcher slurm (to srun); ignored for --launcher ssh."
            in capsys.readouterr().err) == noted


def test_shardwise_help_lists_subcommands_one_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name, command in cli.SUBCOMMANDS.items():
        assert f"\n  {name:<12} {command.summary}\n" in out + "\n"


def test_check_comm_help_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-comm", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardwise check-comm [launcher options]") and "--iters" in out
    assert "--hostfile FILE" not in out  # the launcher's own help is `shardwise --help`


def test_shardwise_estimate_is_the_module_entry_point_under_its_own_name(capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    from shardwise.zero import estimate

    args = ["--params", "1.3e9", "--num_gpus", "8", "--offload"]
    assert cli.main(["estimate", *args]) == 0
    by_subcommand = capsys.readouterr().out
    estimate.main(args)
    assert by_subcommand == capsys.readouterr().out and by_subcommand.count("\nstage ") == 3  # stages 0-3
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--help"])
    assert capsys.readouterr().out.startswith("usage: shardwise estimate [-h] --params PARAMS")
    module = subprocess.run([sys.executable, "-m", "shardwise.zero.estimate", *args], capture_output=True, text=True)
    assert module.returncode == 0 and module.stdout == by_subcommand
    module_help = subprocess.run([sys.executable, "-m", "shardwise.zero.estimate", "--help"], capture_output=True, text=True)
    assert module_help.stdout.startswith("usage: python -m shardwise.zero.estimate")


def test_deepspeed_entry_point_calls_itself_deepspeed(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.deepspeed_main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: deepspeed [options] script.py [script args]\n") and "subcommand" not in out
    code, err = _run(["--num_gpus", "0", str(script)], capsys, cli.deepspeed_main)
    assert code == 2 and err == "deepspeed: error: --num_gpus must be at least 1 (or -1 for all); got 0.\n"
    code, err = _run(["report"], capsys, cli.deepspeed_main)  # DeepSpeed has no subcommands: a script name
    assert code == 2 and "deepspeed: error: script 'report': no such file" in err
    with pytest.raises(SystemExit):
        cli.deepspeed_main(["--launcher", "bogus", str(script)])
    assert "deepspeed: error: argument --launcher: invalid choice: 'bogus'" in capsys.readouterr().err



def test_the_launcher_alone_refuses_autotuning_which_the_commands_hand_to_the_tuner(
        script: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner sits above the launcher: `shardwise`/`deepspeed` pass it in; a bare launch says where it is."""
    import subprocess
    import sys

    from shardwise.autotune import cli as autotune
    from shardwise.launcher.cli import run_launch

    handed: list[tuple[list[str], str, str]] = []
    monkeypatch.setattr(autotune, "from_launcher", lambda argv, mode, prog: handed.append((argv, mode, prog)) or 5)
    assert cli.main(["--autotuning", "run", str(script)]) == 5 and cli.deepspeed_main(["--autotuning", "tune"]) == 5
    assert handed == [(["--autotuning", "run", str(script)], "run", "shardwise"), (["--autotuning", "tune"], "tune",
                                                                                    "deepspeed")]
    assert run_launch(["--autotuning", "tune", str(script)], "shardwise") == 2
    assert capsys.readouterr().err == ("shardwise: error: --autotuning tune: this entry point only launches; run the "
                                       "shardwise or deepspeed command (python -m shardwise.cli), which starts the "
                                       "tuner.\n")
    bare = subprocess.run([sys.executable, "-m", "shardwise.launcher.cli", "--num_gpus", "0", str(script)],
                          capture_output=True, text=True, timeout=60)  # still a launch, not a silent no-op
    assert (bare.returncode, bare.stderr) == (2, "shardwise: error: --num_gpus must be at least 1 (or -1 for all); "
                                                 "got 0.\n")

def test_ds_report_takes_deepspeeds_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.launcher import report

    monkeypatch.setattr(report, "_pieces", lambda: [("CPU Adam", "no (ImportError: x)")])
    assert report.ds_report_main(["--json", "--hide_errors_and_warnings"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["CPU Adam"] == "no" and "torch" in shown
    assert report.ds_report_main(["--json", "--hide_operator_status"]) == 0
    assert "CPU Adam" not in json.loads(capsys.readouterr().out)


def test_the_rank_bootstrap_leaves_loading_torch_to_the_script(tmp_path: Path) -> None:
    """bootstrap.py runs before every rank's script and is stdlib only: a script (or an `exec` target) that does not
    use torch must not pay its import (~1 s of CPU and ~300 MB per rank)."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text("import sys\nprint(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    result = subprocess.run([sys.executable, "-m", "shardwise.launcher.bootstrap", "path", str(script)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
