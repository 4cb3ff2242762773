"""tools/deepspeed_shm_leftovers.py removes only the DeepSpeed all-reduce buffers that nothing uses any more."""

from __future__ import annotations

import importlib.util
import mmap
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "deepspeed_shm_leftovers.py"


def _tool():
    spec = importlib.util.spec_from_file_location("deepspeed_shm_leftovers", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_buffers_no_process_maps_or_holds_open_are_removed(tmp_path: Path) -> None:
    names = ["deepspeed_allreduce_buffer_0_127.0.0.1_1_0", "deepspeed_allreduce_buffer_0_127.0.0.1_1_1",
             "deepspeed_allreduce_buffer_0_127.0.0.1_2_0", "shardwise-abc"]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 4096)
    with open(tmp_path / names[0], "r+b") as mapped, open(tmp_path / names[1], "rb"):
        view = mmap.mmap(mapped.fileno(), 4096)  # mapped: a live job's buffer (its fd closed below)
        mapped.close()
        assert _tool().leftovers(tmp_path) == [tmp_path / names[2]]
        (tmp_path.parent / "link").symlink_to(tmp_path)  # named by another path, the mapped file is still in use
        assert _tool().leftovers(tmp_path.parent / "link") == [tmp_path.parent / "link" / names[2]]
        done = subprocess.run([sys.executable, str(TOOL), "--dir", str(tmp_path)], capture_output=True, text=True,
                              check=True)
        view.close()
    assert "removed" in done.stdout and names[2] in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [names[0], names[1], names[3]]
    assert _tool().leftovers(tmp_path) == [tmp_path / names[0], tmp_path / names[1]]  # let go: leftovers now
