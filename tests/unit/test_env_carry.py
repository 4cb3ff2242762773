"""What travels to every node: prefixed variables, the venv, and .deepspeed_env/.shardwise_env lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.launcher.remote_env import EnvFileError, carried_env, parse_env_file

ENVIRON = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "HOME": "/root", "PATH": "/usr/bin", "SECRET": "x",
           "TORCHELASTIC_RUN_ID": "old", "GLOO_SOCKET_IFNAME": "eth1", "VIRTUAL_ENV": "/venv", "WANDB_KEY": "k",
           "SHARDWISE_RANK_PYTHON": "numactl -i all python", "SHARDWISE_OTHER": "x"}


def test_prefixed_variables_and_venv_are_carried(tmp_path: Path) -> None:
    got = carried_env(ENVIRON, str(tmp_path), str(tmp_path))
    assert got == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "GLOO_SOCKET_IFNAME": "eth1", "VIRTUAL_ENV": "/venv",
                   "SHARDWISE_RANK_PYTHON": "numactl -i all python"}


def test_env_files_home_then_cwd_later_wins(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".shardwise_env").write_text("# comment\nB=cwd with spaces\nexport C=3\nWANDB_KEY\n")
    got = carried_env(ENVIRON, str(cwd), str(home))
    assert (got["A"], got["B"], got["C"], got["WANDB_KEY"]) == ("home", "cwd with spaces", "3", "k")
    assert "SECRET" not in got


def test_named_env_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(EnvFileError, match="no such file"):
        carried_env({"DS_ENV_FILE": str(tmp_path / "missing")}, str(tmp_path), str(tmp_path))


@pytest.mark.parametrize(
    ("text", "message"),
    [("1BAD=x", "line 1 ('1BAD=x'): '1BAD' is not a valid variable name"),
     ("OK=1\nMISSING_HERE", "line 2 ('MISSING_HERE'): MISSING_HERE is not set here"),
     ("A B=1", "'A B' is not a valid variable name")],
)
def test_env_file_mistakes_quote_the_line(text: str, message: str) -> None:
    with pytest.raises(EnvFileError) as error:
        parse_env_file(text, ".shardwise_env", {})
    assert message in str(error.value)
