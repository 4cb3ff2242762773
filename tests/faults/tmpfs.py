"""A small tmpfs for full-disk faults (as tests/distributed/test_offload_memory_faults.py mounts one).

The test skips only when the mount itself is refused (not root, no mount permission): never because of
what the code under test does on it.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

PAGE = 4096


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of `size_bytes` (rounded up to pages) at `path` for the duration."""
    path.mkdir(parents=True, exist_ok=True)
    size = -(-size_bytes // PAGE) * PAGE
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root and mount permission): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        # A file the code under test left open makes the plain umount fail; the lazy one still detaches it.
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=False)


def bytes_on_tmpfs(directory: Path) -> int:
    """What the files under `directory` take on a tmpfs (whole pages per file)."""
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in directory.rglob("*") if f.is_file())
