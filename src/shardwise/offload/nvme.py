"""Tensors swapped to files on a fast disk with asynchronous I/O.

Each rank owns a directory under `nvme_path`. A swap file is allocated at full size when it is
created (`posix_fallocate`), so a disk that is too small fails at start-up, before training has
produced anything to lose. Reads and writes go through a thread pool in `block_size` pieces
(several in flight: the disk, the CPU optimizer and the device stay busy together); files are opened
with O_DIRECT where the filesystem allows it, with page-aligned host buffers. Files are removed at a
clean exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import errno
import itertools
import mmap
import os
import shutil
from pathlib import Path

import torch

from ..config.sections import AioConfig

_ALIGN = 4096
_COUNTER = itertools.count()


class NvmeError(RuntimeError):
    """Swapping failed; the message names the path and what to do."""


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor in page-aligned memory (what O_DIRECT needs), padded to a whole page."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN))
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].view(dtype)


class NvmeSwapper:
    def __init__(self, nvme_path: str, section: str, rank: int, aio: AioConfig):
        self.section = section
        self.dir = Path(nvme_path) / f"shardwise-rank{rank}-pid{os.getpid()}-{section}-{next(_COUNTER)}"
        self.block = -(-aio.block_size // _ALIGN) * _ALIGN
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=aio.thread_count * aio.queue_depth,
                                                          thread_name_prefix="shardwise-aio")
        self._direct = True
        self._sizes: dict[str, int] = {}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".probe"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            raise NvmeError(f"zero_optimization.{section}.nvme_path: cannot write to {nvme_path!r}: {e.strerror}. "
                            "Point nvme_path at an existing, writable directory on a local disk.") from None
        atexit.register(self.close)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.swp"

    def _open(self, name: str, flags: int, direct: bool) -> int:
        path = self.path(name)
        if not path.exists() and not flags & os.O_CREAT:
            raise NvmeError(f"NVMe offload: swap file {str(path)!r} is missing (deleted while training?); the state "
                            "in it is lost. Resume from the last checkpoint, and keep nvme_path out of cleanup jobs.")
        if direct and self._direct:
            try:
                return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False  # tmpfs and some filesystems refuse O_DIRECT
        return os.open(path, flags, 0o600)

    def allocate(self, name: str, nbytes: int) -> None:
        """Create the swap file at its full (page-rounded) size now, so a full disk fails early."""
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        fd = self._open(name, os.O_RDWR | os.O_CREAT, direct=False)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise NvmeError(f"NVMe offload: cannot allocate {size / 2**20:.1f} MiB for {str(self.path(name))!r}: "
                            f"{e.strerror}. Free space there or point nvme_path at a larger disk.") from None
        finally:
            os.close(fd)
        self._sizes[name] = size

    def _io(self, name: str, tensor: torch.Tensor, write: bool) -> list[concurrent.futures.Future]:
        nbytes = tensor.numel() * tensor.element_size()
        padded = -(-nbytes // _ALIGN) * _ALIGN
        storage, start = tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size()
        # O_DIRECT moves whole pages between page-aligned memory and the file: only for our aligned buffers.
        direct = start == 0 and storage.nbytes() >= padded and storage.data_ptr() % _ALIGN == 0
        length = padded if direct else nbytes
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, start, (length,))
        fd = self._open(name, os.O_RDWR if write else os.O_RDONLY, direct)
        # [Note: swap buffers die with their last future] The pieces reach the buffer through `held`, which the
        # last future clears: a worker thread keeps its finished task for a moment after the future is done, and
        # a task holding the buffer itself would keep the tensor alive into the next step on a loaded machine.
        held = {"buffer": memoryview(raw.numpy())}
        del raw

        def piece(offset: int) -> None:
            view = held["buffer"][offset : min(offset + self.block, length)]
            try:
                done = os.pwrite(fd, view, offset) if write else os.preadv(fd, [view], offset)
            except OSError as e:
                raise NvmeError(f"NVMe offload: {'writing' if write else 'reading'} {str(self.path(name))!r} failed: "
                                f"{e.strerror}.") from None
            if done != len(view):
                raise NvmeError(f"NVMe offload: short {'write' if write else 'read'} on {str(self.path(name))!r} "
                                f"({done} of {len(view)} bytes): the file was truncated or the disk is full.")

        futures = [self.pool.submit(piece, off) for off in range(0, length, self.block)]

        def close_when_done() -> None:
            concurrent.futures.wait(futures)
            held.clear()
            os.close(fd)

        return [*futures, self.pool.submit(close_when_done)]

    def write(self, name: str, tensor: torch.Tensor) -> list[concurrent.futures.Future]:
        return self._io(name, tensor, write=True)

    def read(self, name: str, out: torch.Tensor) -> list[concurrent.futures.Future]:
        return self._io(name, out, write=False)

    @staticmethod
    def wait(futures: list[concurrent.futures.Future]) -> None:
        for f in futures:
            f.result()

    def close(self) -> None:
        """Remove the swap files (at a clean exit, or when the engine is destroyed)."""
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)
