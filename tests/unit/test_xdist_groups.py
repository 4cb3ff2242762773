"""`make test`'s scheduling: each test file runs whole on one xdist worker (its module fixtures computed once), and
the network-namespace modules share one worker. This silently stopped holding once already (every test became its
own group when pytest 9 dropped xdist's @group node-id suffix), costing minutes of CI per run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RECORDING_TEST = """
import os, pathlib

def record(name):
    with open(pathlib.Path(__file__).parent / "ran.txt", "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""


def test_each_file_and_the_hosts_group_run_whole_on_one_worker(tmp_path: Path) -> None:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "recorder.py").write_text(RECORDING_TEST)
    modules = ["test_alpha", "test_beta", "test_gamma", "test_multinode", "test_elastic"]
    for module in modules:
        body = "".join(f"def test_{i}():\n    import time; time.sleep(0.05); record('{module}')\n\n" for i in range(6))
        (tmp_path / f"{module}.py").write_text(f"from recorder import record\n\n{body}")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadscope",
         "--no-loadscope-reorder", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    workers: dict[str, set[str]] = {}
    for line in (tmp_path / "ran.txt").read_text().splitlines():
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    assert set(workers) == set(modules)
    assert all(len(ran_on) == 1 for ran_on in workers.values()), workers
    assert workers["test_multinode"] == workers["test_elastic"], workers
    assert len(set.union(*workers.values())) == 2, f"one worker did everything: {workers}"


LEAKING_TESTS = """
import os

def test_leaks(monkeypatch):
    monkeypatch.delenv("SHARDWISE_GUARD_PROBE", raising=False)  # absent: records nothing to undo
    os.environ["SHARDWISE_GUARD_PROBE"] = "lo"

def test_after_it():
    assert "SHARDWISE_GUARD_PROBE" not in os.environ

def test_restores_with_monkeypatch(monkeypatch):
    monkeypatch.setenv("SHARDWISE_GUARD_PROBE", "lo")

def test_a_library_owned_variable_may_stay():
    os.environ["_TORCHINDUCTOR_GUARD_PROBE"] = "1"

START = os.getcwd()

def test_changes_folder(tmp_path):
    os.chdir(tmp_path)

def test_back_in_its_folder():
    assert os.getcwd() == START
"""


def test_a_variable_or_folder_a_test_leaves_behind_fails_it_and_is_undone(tmp_path: Path) -> None:
    """A worker's tests share its environment: a leaked GLOO_SOCKET_IFNAME=lo once broke every multi-node test that
    ran after it on the same worker (conftest.py's `_environment_unchanged`)."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(LEAKING_TESTS)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if "GUARD_PROBE" not in k})
    assert "6 passed, 2 errors" in result.stdout, result.stdout
    assert "ERROR at teardown of test_leaks" in result.stdout and "ERROR at teardown of test_changes_folder" in result.stdout
    assert "os.environ ['SHARDWISE_GUARD_PROBE'], {}" in result.stdout
    assert "os.environ [], {'working folder'" in result.stdout
