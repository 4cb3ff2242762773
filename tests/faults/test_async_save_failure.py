"""A background save (`"checkpoint": {"async_save": true}`) that fails is never silent.

It used to fail on its thread and be forgotten: on a full disk the script exited 0 and printed nothing.
Now the failure is raised by the next `engine.step()` (or save/load), or, if the script never makes
another such call, printed at exit with a non-zero exit status; `latest` keeps naming the last good tag
and the failed tag's `.partial` directory is removed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch.distributed as dist

from tests.faults.checkpoint_models import NO_SPACE, error_of, tiny_engine, train_step
from tests.faults.tmpfs import bytes_on_tmpfs, small_tmpfs
from tests.harness import run_distributed

SRC = Path(__file__).resolve().parents[2] / "src"
ASYNC = {"checkpoint": {"async_save": True}}


def _save(root: str, tags: tuple[str, ...]) -> None:
    engine = tiny_engine(**ASYNC)
    for tag in tags:
        train_step(engine)
        engine.save_checkpoint(root, tag=tag)
        engine.checkpoint_writer.wait()


def _fail_in_background(root: str) -> tuple[str, str]:
    engine = tiny_engine(**ASYNC)
    train_step(engine)
    engine.save_checkpoint(root, tag="first")
    train_step(engine)  # the first write may still run: step() must not wait for it, nor fail
    engine.checkpoint_writer.wait()
    engine.save_checkpoint(root, tag="second")  # returns at once; the write runs out of space
    engine.checkpoint_writer._thread.join()  # the test waits for the write to end; step() itself never joins
    dist.barrier()
    failed = error_of(train_step, engine)
    train_step(engine)  # reported once: training may go on
    return failed, tiny_engine().load_checkpoint(root)[0]


def test_failed_background_save_is_raised_by_the_next_step(tmp_path: Path) -> None:
    run_distributed(_save, 2, str(tmp_path / "reference"), ("one",))
    one = bytes_on_tmpfs(tmp_path / "reference")
    with small_tmpfs(tmp_path / "tiny", one + one // 2) as root:  # room for one checkpoint, not two
        per_rank = run_distributed(_fail_in_background, 2, str(root))
        assert per_rank[0] == per_rank[1], per_rank  # the same error on every rank
        message, loaded = per_rank[0]
        assert message.startswith(f"CheckpointError: the background checkpoint save failed: save_checkpoint: tag "
                                  f"'second' in {root} was not saved: rank "), message
        assert re.search(NO_SPACE.format(root=re.escape(str(root))), message), message
        assert message.endswith("`latest` names 'first'."), message
        assert loaded == str(root / "first")
        assert sorted(p.name for p in root.iterdir()) == ["first", "latest"]


def test_step_does_not_wait_for_a_running_save() -> None:
    from shardwise.checkpoint.writer import CheckpointWriter

    writer = CheckpointWriter(async_save=True, tag_validation="Warn")
    release = threading.Event()
    writer._thread = threading.Thread(target=release.wait, args=(60,))
    writer._thread.start()
    writer.check()  # returns at once: were it to join, this test would wait 60 s and fail below
    assert writer._thread.is_alive()
    release.set()
    writer.wait()


SCRIPT = textwrap.dedent(
    '''
    """A training script that ends right after an async save, without waiting for it."""
    import sys
    import torch
    import shardwise

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    engine, *_ = shardwise.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1}, "checkpoint": {"async_save": True}})
    for tag in ("first", "second"):
        engine.backward(engine(torch.randn(4, 32)).square().mean())
        engine.step()
        engine.save_checkpoint(sys.argv[-1], tag=tag)  # the launcher passes --local_rank first
    print("the script returned", flush=True)
    '''
)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # the caller's PYTHONPATH first (the code under test), this checkout's sources as the fallback
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(SRC)) if p))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def test_unreported_background_failure_fails_the_process(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launch = ["-m", "shardwise.cli", "--num_gpus", "2", str(script)]
    healthy = _run([*launch, str(tmp_path / "healthy")], tmp_path)
    assert healthy.returncode == 0, healthy.stderr[-3000:]
    assert "CheckpointError" not in healthy.stdout + healthy.stderr
    assert (tmp_path / "healthy" / "latest").read_text() == "second"
    one = bytes_on_tmpfs(tmp_path / "healthy" / "first") + 4096  # + `latest`
    with small_tmpfs(tmp_path / "tiny", one + one // 2) as root:  # room for "first", not "second"
        failed = _run([*launch, str(root)], tmp_path)
        output = failed.stdout + failed.stderr
        assert failed.returncode == 1, output[-3000:]
        assert output.count("the script returned") == 2, output[-3000:]  # both ranks ran to the end
        assert (f"CheckpointError: the background checkpoint save failed: save_checkpoint: tag 'second' in {root} "
                "was not saved: rank ") in output, output[-3000:]
        assert "no space left on device (" in output and "The process exits with status 1." in output
        assert (root / "latest").read_text() == "first"
        assert sorted(p.name for p in root.iterdir()) == ["first", "latest"]
