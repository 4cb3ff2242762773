"""The engine's checkpoint writer: agrees on the tag, then writes now or from a background thread.

[Note: background save failures] With `async_save` the write runs on a thread after `save_checkpoint`
returns, so its failure (a full disk) has no caller to raise in. It is raised, on every rank alike (see
`save.write_and_publish`), at the next engine call that touches checkpoints or the step: `step()` checks
without waiting (a running write is left alone), `save_checkpoint`/`load_checkpoint`/`destroy` wait for it.
A failure still unreported when the process ends is printed to stderr, written to the launcher's error
file, and the process exits with status 1 (an exit hook cannot change the status any other way), so a
script can never end "successfully" with its last checkpoint missing.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..error_file import write_error_file
from ..protocols import TrainingEngine
from .errors import CheckpointError
from .save import SaveJob, pack_job, prepare, write_and_publish
from .tags import save_tag_problem

EXIT_STATUS = 1


class CheckpointWriter:
    """Writes checkpoints, synchronously or (async_save) from one background thread at a time.

    The background thread coordinates on a process group of its own, so its collectives never
    interleave with the training loop's on the main group.
    """

    def __init__(self, async_save: bool, tag_validation: str):
        self.async_save = async_save
        self.tag_validation = tag_validation.lower()
        self._thread: threading.Thread | None = None
        self._job: SaveJob | None = None
        self._error: BaseException | None = None
        self._group: dist.ProcessGroup | None = None
        self._exit_hook = False

    def check(self) -> None:
        """Raise a finished background save's failure; never waits for one still running (cheap: for step())."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):  # it names the tag, the directory and the cause
                raise CheckpointError(f"the background checkpoint save failed: {error}") from error
            job = self._job
            raise CheckpointError(f"the background save of tag {job.tag!r} to {job.root} failed: "
                                  f"{type(error).__name__}: {error}") from error

    def save(self, engine: TrainingEngine, save_dir: str, tag: str | None, client_state: dict[str, Any], save_latest: bool,
             exclude_frozen: bool = False) -> str:
        self.wait()
        tag = self._agree_on_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
        root = Path(save_dir)
        job = pack_job(engine, root, tag, client_state, save_latest, copy=self.async_save, exclude_frozen=exclude_frozen)
        prepare(root, tag)
        if not self.async_save:
            write_and_publish(job, group=None)
            return str(root / tag)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        if not self._exit_hook:
            atexit.register(_report_at_exit, weakref.ref(self))
            self._exit_hook = True
        self._job = job
        self._thread = threading.Thread(target=self._run, args=(job,), name="shardwise-checkpoint", daemon=False)
        self._thread.start()
        return str(root / tag)

    def _run(self, job: SaveJob) -> None:
        try:
            write_and_publish(job, group=self._group)
        except BaseException as e:  # noqa: BLE001 - raised by check()/wait() on the main thread, or at exit
            self._error = e

    def _agree_on_tag(self, tag: str) -> str:
        """The tag every rank saves under, or the same error on every rank.

        The ranks first exchange their tags (strings only: nothing is written before this), so a bad or
        differing tag is refused on every rank; raising on one rank before the exchange would leave the
        others waiting in it. DeepSpeed's "Warn" (save anyway) cannot work here: each rank writes its own
        file into the tag's directory, so ranks with different tags would each write an incomplete
        checkpoint. "Ignore" saves under rank 0's tag.
        """
        tags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(tags, tag)
        checked = tags[:1] if self.tag_validation == "ignore" else tags
        bad = {rank: problem for rank, problem in enumerate(map(save_tag_problem, checked)) if problem}
        if bad:
            detail = "; ".join(f"rank {rank}: {problem}" for rank, problem in bad.items())
            raise CheckpointError(f"save_checkpoint: tag {bad[0] if len(set(checked)) == 1 else detail}. "
                                  "Nothing was written.")
        if len(set(tags)) > 1 and self.tag_validation != "ignore":
            per_rank = ", ".join(f"rank {rank}: {t!r}" for rank, t in enumerate(tags))
            raise CheckpointError(
                f"save_checkpoint: every rank must pass the same tag; got {per_rank}. Each rank writes its own file "
                "into the tag's directory, so differing tags cannot make a checkpoint (DeepSpeed's tag_validation "
                "\"Warn\" is therefore an error here too; \"Ignore\" saves under rank 0's tag). Nothing was written.")
        return tags[0]


def _report_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit (the writer thread is non-daemon, so it has finished): report a failure no
    engine call raised, and exit non-zero. A healthy run's exit is untouched."""
    writer = ref()
    if writer is None:
        return
    try:
        writer.wait()
    except CheckpointError as e:
        _record(CheckpointError(f"{e} The process exits with status {EXIT_STATUS}."))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STATUS)  # skips later exit hooks, but SystemExit raised in one is ignored by Python


def _record(error: CheckpointError) -> None:
    """Print `error`, and give it to the launcher (its error file) unless the script's own failure is there."""
    text = f"{type(error).__name__}: {error}"
    sys.stderr.write(text + "\n")
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (path and os.path.exists(path)):
        write_error_file(text, "")
