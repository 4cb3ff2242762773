"""The command-line tools the README names, run as a user runs them: ``shardwise report``, ``shardwise check-comm``
under the launcher at world size 2, and ``python -m shardwise.zero.estimate``."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_launcher import LAUNCH_TIMEOUT_S, child_env

pytestmark = [pytest.mark.timeout(180)]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=child_env(), capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def test_report_lists_versions_devices_and_pieces_that_ran(tmp_path: Path) -> None:
    from shardwise.version import __version__

    got = json.loads(_run(["-m", "shardwise.cli", "report", "--json"], tmp_path).stdout)
    assert (got["shardwise"], got["torch"], got["python"]) == (__version__, torch.__version__, platform.python_version())
    assert got["CPU cores"] == str(os.cpu_count()) and got["gloo backend"] == "yes"
    assert got["CUDA devices"] == ("none" if not torch.cuda.is_available() else got["CUDA devices"])
    assert got["CPU Adam"] == "yes (torch fused AdamW on CPU)" and got["async I/O (NVMe)"] == "yes"
    for tool in ("ssh", "pdsh", "mpirun", "srun", "kubectl"):
        assert got[f"launcher: {tool}"] == (shutil.which(tool, path=child_env()["PATH"]) or "not found")


def test_report_table_says_why_a_piece_does_not_work(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Each piece is run, not just imported: a CPU Adam that cannot step is reported with the error."""
    from shardwise import cli

    class BrokenAdamW:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("fused kernel not built for this CPU")

    monkeypatch.setattr(torch.optim, "AdamW", BrokenAdamW)
    assert cli.main(["report"]) == 0
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in capsys.readouterr().out.splitlines()}
    assert rows["CPU Adam"] == "no (RuntimeError: fused kernel not built for this CPU)"
    assert rows["gloo backend"] == "yes" and rows["torch"] == torch.__version__


def test_check_comm_under_the_launcher_at_world_size_2(tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    result = _run(["-m", "shardwise.cli", "check-comm", "--num_gpus", "2", "--sizes", "4K,64K", "--iters", "2",
                   "--json", str(out)], tmp_path)
    # The sanity checks: every rank says what it received.
    assert "rank 0/2 on " in result.stdout and ": broadcast got 42, all_reduce got 3 (expected 3) OK" in result.stdout
    assert "broadcast got 42, recv from rank 0 got 7, all_reduce got 3 (expected 3) OK" in result.stdout  # rank 1
    assert "check-comm: 2 ranks, backend gloo" in result.stdout
    rows = json.loads(out.read_text())
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    assert [(r["op"], r["bytes"], r["world"]) for r in rows] == [(op, size, 2) for op in ops for size in (4096, 65536)]
    # Bandwidths by nccl-tests' conventions, written out for 2 ranks: algbw = bytes / time; busbw = algbw × 2(n-1)/n
    # for all_reduce (1 at n = 2) and × (n-1)/n (1/2) for the others.
    for r in rows:
        assert r["time_us"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * (1.0 if r["op"] == "all_reduce" else 0.5), rel=1e-9)
        size = {4096: "4K", 65536: "64K"}[r["bytes"]]
        assert f"{r['op']:<15}{size:>10}{r['time_us']:>12.1f}{r['algbw_GBps']:>14.3f}{r['busbw_GBps']:>14.3f}" in result.stdout


GIB = 2**30


def _estimate_line(stage: int, device: float, host: float, flags: str) -> str:
    return f"stage {stage}, 8 rank(s), 1000.0M params, {flags}: {device / GIB:.2f} GiB device + {host / GIB:.2f} GiB host per rank"


def test_estimator_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    psi, n = 1e9, 8
    # Mixed precision, optimizer offloaded: 2Ψ bf16 parameters, 2Ψ gradients on the device; 12Ψ (fp32 master and
    # two Adam moments) in host memory. Stage 1 partitions the 12Ψ, stage 2 the gradients too, stage 3 everything.
    offload = _run(["-m", "shardwise.zero.estimate", "--params", "1e9", "--num_gpus", "4", "--num_nodes", "2",
                    "--offload"], tmp_path).stdout.splitlines()
    assert offload == [
        _estimate_line(0, 4 * psi, 12 * psi, "mixed, offload"),
        _estimate_line(1, 4 * psi, 12 * psi / n, "mixed, offload"),
        _estimate_line(2, 2 * psi + 2 * psi / n, 12 * psi / n, "mixed, offload"),
        _estimate_line(3, 4 * psi / n, 12 * psi / n, "mixed, offload"),
    ]
    # fp32, nothing offloaded: 4Ψ parameters, 4Ψ gradients, 8Ψ Adam moments, all on the device.
    from shardwise.zero.estimate import main

    main(["--params", "1e9", "--num_gpus", "8", "--fp32"])
    assert capsys.readouterr().out.splitlines() == [
        _estimate_line(0, 16 * psi, 0, "fp32"),
        _estimate_line(1, 8 * psi + 8 * psi / n, 0, "fp32"),
        _estimate_line(2, 4 * psi + 12 * psi / n, 0, "fp32"),
        _estimate_line(3, 16 * psi / n, 0, "fp32"),
    ]
