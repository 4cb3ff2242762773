"""The pre-imported interpreter that forks tests/compat's scripts (zygote.py) must report what a fresh process
would: the exit code and output of each rank, a failure with its traceback, and a hang as a timeout."""

from __future__ import annotations

import sys

import pytest

from tests.compat.zygote import ScriptTimeout, Zygote


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(sys.executable, {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
               str(tmp_path_factory.mktemp("zygote")), preload=("torch",))
    yield z
    z.close()


def _run(zygote, tmp_path, source: str, *args: str, world: int = 1, timeout: float = 60):
    script = tmp_path / "script.py"
    script.write_text(source)
    outputs = [(str(tmp_path / f"{r}.out"), str(tmp_path / f"{r}.err")) for r in range(world)]
    envs = [{"RANK": str(r), "MARK": "set"} for r in range(world)]
    codes = zygote.run(str(script), list(args), str(tmp_path), envs, outputs, timeout)
    return codes, [(open(o).read(), open(e).read()) for o, e in outputs]


def test_a_run_sees_its_argv_env_cwd_and_exits_like_a_process(zygote, tmp_path):
    source = ("import atexit, os, sys\natexit.register(lambda: print('atexit ran'))\n"
              "print(sys.argv[1:], os.environ['RANK'], os.environ['MARK'], os.getcwd() == sys.argv[1], __name__,\n"
              "      'torch' in sys.modules, 'shardwise' in sys.modules)\n")
    codes, texts = _run(zygote, tmp_path, source, str(tmp_path), world=2)
    assert codes == [0, 0]
    for rank, (out, _) in enumerate(texts):  # torch preloaded; the code under test (shardwise) loads fresh
        assert out == f"['{tmp_path}'] {rank} set True __main__ True False\natexit ran\n"
    codes, _ = _run(zygote, tmp_path, "import sys\nsys.exit(3)\n")
    assert codes == [3]


def test_a_failing_rank_reports_its_traceback_and_stops_the_others(zygote, tmp_path):
    source = ("import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('rank one broke')\n"
              "time.sleep(120)\n")
    codes, texts = _run(zygote, tmp_path, source, world=2)
    assert codes[1] == 1 and codes[0] != 0  # rank 0 was stopped, not left sleeping
    assert "ValueError: rank one broke" in texts[1][1]


def test_a_hanging_run_times_out_and_is_killed(zygote, tmp_path):
    with pytest.raises(ScriptTimeout):
        _run(zygote, tmp_path, "import time\ntime.sleep(120)\n", timeout=3)
    codes, texts = _run(zygote, tmp_path, "print('still serving')\n")  # the zygote itself goes on
    assert codes == [0] and texts[0][0] == "still serving\n"
