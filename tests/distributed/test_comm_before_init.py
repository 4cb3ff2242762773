"""``deepspeed.comm.get_rank()``/``get_world_size()``/``get_local_rank()`` before the process group exists.

DeepSpeed 0.19.8 asserts ("DeepSpeed backend not set"). shardwise answers from the launcher's variables, which
are what ``init_distributed`` joins with, and raises where there are none: a process started without a launcher
may yet be given its rank (``mp.spawn`` passes it to ``init_process_group``), so 0 / 1 could be wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from deepspeed import comm
from tests.distributed.test_multinode import child_env

pytestmark = [pytest.mark.timeout(120)]

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "PET_NNODES", "PET_NODE_RANK",
                 "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT")
SCRIPT = textwrap.dedent('''
    import json, os, sys
    from deepspeed import comm
    import deepspeed

    before = [comm.get_rank(), comm.get_world_size(), comm.get_local_rank()]
    deepspeed.init_distributed(dist_backend="gloo")
    with open(f"rank{comm.get_rank()}.json", "w") as f:
        json.dump({"before": before, "after": [comm.get_rank(), comm.get_world_size(), comm.get_local_rank()]}, f)
''')


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    assert not dist.is_initialized()
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_launched_ranks_answer_before_init_as_after(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(SCRIPT)
    result = subprocess.run([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--no_local_rank",
                             "probe.py"], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"before": [rank, 2, rank], "after": [rank, 2, rank]}


@pytest.mark.parametrize(("environ", "expected"), [
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2, 1)),  # shardwise, torchrun
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2"}, (1, 2, 1)),  # DeepSpeed's launcher
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n1"}, (3, 4, 1)),
    ({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
      "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}, (1, 2, 0)),
    ({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
      "PET_MASTER_PORT": "29400"}, (1, 2, 0)),  # a TrainJob pod
])
def test_launcher_variables_answer_before_init(no_launcher: pytest.MonkeyPatch, environ: dict[str, str],
                                               expected: tuple[int, int, int]) -> None:
    for name, value in environ.items():
        no_launcher.setenv(name, value)
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank()) == expected


def test_without_a_launcher_before_init_is_an_error_not_rank_0(no_launcher: pytest.MonkeyPatch) -> None:
    for ask in (comm.get_rank, comm.get_world_size, comm.get_local_rank):
        with pytest.raises(RuntimeError, match=rf"comm.{ask.__name__}\(\): torch.distributed is not initialised and no "
                                               r"launcher's variables .* call deepspeed.init_distributed\(\)"):
            ask()
    no_launcher.setenv("RANK", "0")
    no_launcher.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match=r"comm.get_rank\(group=...\): torch.distributed is not initialised"):
        comm.get_rank(group=object())
