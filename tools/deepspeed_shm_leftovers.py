"""Remove the shared-memory buffers that DeepSpeed's CPU all-reduce left behind in /dev/shm.

DeepSpeed 0.19's shm comm op (ShareMemCommBuilder, used by every CPU run at world > 1) creates
`deepspeed_allreduce_buffer_*` files, 66 MB per rank at world 2, and never unlinks them: each parity run of
`make test-deepspeed` left ~2 of them, and a long-lived machine had 34 (2.2 GB of RAM, /dev/shm being tmpfs).
A file is removed only when it belongs to this user and no process has it mapped or open, so a DeepSpeed job
running beside the tests keeps its buffers.

    python tools/deepspeed_shm_leftovers.py [--dir /dev/shm]   # prints what it removed
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PATTERN = "deepspeed_allreduce_buffer_*"


def in_use() -> set[str]:
    """Every path some process we may inspect has mapped or open."""
    paths: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:  # address perms offset device inode [path]
                paths.update(fields[5].strip() for fields in (line.split(None, 5) for line in maps) if len(fields) == 6)
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile, or another user's
            continue
        for fd in fds:
            try:
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed meanwhile (listing the directory opens one)
                pass
    return {p.removesuffix(" (deleted)") for p in paths}


def leftovers(directory: Path) -> list[Path]:
    busy = in_use()  # the kernel names files by their real paths: compare those, whatever `directory` was called
    return sorted(p for p in directory.glob(PATTERN)
                  if p.is_file() and p.stat().st_uid == os.getuid() and os.path.realpath(p) not in busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()
    if not args.dir.is_dir():
        return
    removed = 0
    for path in leftovers(args.dir):
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        removed += size
        print(f"removed {path} ({size / 2**20:.0f} MiB): DeepSpeed's all-reduce buffer, no longer used")
    if removed:
        print(f"deepspeed_shm_leftovers: {removed / 2**20:.0f} MiB freed in {args.dir}")


if __name__ == "__main__":
    main()
