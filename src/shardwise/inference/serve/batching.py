"""Which queued prompts generate together (pure), and the queue that hands them from the HTTP thread to the loop.

Each prompt of a request is a `Row` with its own future. Rank 0's loop takes a batch of rows at a time: the
oldest row, then younger ones that sample alike, up to `max_batch_size`, as long as the batch's longest prompt plus
its largest `max_tokens` fits the key/value cache (`max_out_tokens`). A row sampled with a seed generates alone:
its random draws then depend on its seed only, not on what shared its batch. Greedy rows batch freely: with left
padding and the attention mask, a row's tokens do not depend on its batch mates (up to float rounding).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal


class ShuttingDown(RuntimeError):
    """The server is stopping; the request was not (and will not be) generated."""


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def alone(self) -> bool:
        """A seeded sampled row: reproducible only if nothing else draws from the generator in its batch."""
        return self.seed is not None and not self.greedy

    def key(self) -> tuple:
        return ("greedy",) if self.greedy else ("sample", self.temperature, self.top_p)

    def generate_kwargs(self) -> dict[str, Any]:
        """Hugging Face `generate` keywords. Sampling passes `top_k=0`: OpenAI's sampling has no top-k cut, and
        Hugging Face's default would keep only the 50 likeliest tokens."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


@dataclass
class Row:
    """One prompt on its way through the queue; `future` gets a `protocol.Finished` or an exception."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...] = ()
    future: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Batch:
    """What rank 0 broadcasts to the other tensor-parallel ranks: everything `generate` is called with."""

    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    max_new_tokens: int
    pad_token_id: int
    eos_token_id: list[int]
    sampling: Sampling


Message = Batch | Literal["stop", "idle"]


def take_batch(pending: list[Row], max_batch_size: int, max_out_tokens: int) -> list[Row]:
    """Remove from `pending` (oldest first) and return the rows to generate next; empty if nothing is pending."""
    if not pending:
        return []
    first = pending[0]
    batch, longest, most = [first], len(first.prompt_ids), first.max_tokens
    if not first.sampling.alone:
        for row in pending[1:]:
            if len(batch) == max_batch_size:
                break
            fits = max(longest, len(row.prompt_ids)) + max(most, row.max_tokens) <= max_out_tokens
            if row.sampling.key() == first.sampling.key() and not row.sampling.alone and fits:
                batch.append(row)
                longest, most = max(longest, len(row.prompt_ids)), max(most, row.max_tokens)
    taken = {id(r) for r in batch}
    pending[:] = [r for r in pending if id(r) not in taken]
    return batch


def left_padded(rows: list[Row], pad_token_id: int, eos_token_id: list[int]) -> Batch:
    """The batch with prompts padded on the left (new tokens then follow every prompt at the same position)."""
    width = max(len(r.prompt_ids) for r in rows)
    ids = [[pad_token_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows]
    mask = [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows]
    return Batch(ids, mask, max(r.max_tokens for r in rows), pad_token_id, eos_token_id, rows[0].sampling)


class RequestQueue:
    """Rows submitted by the HTTP thread, taken in batches by rank 0's loop; closed when the server stops."""

    def __init__(self) -> None:
        self._rows: list[Row] = []
        self._ready = threading.Condition()
        self._closed = False

    def submit(self, rows: list[Row]) -> None:
        """Queue a request's rows together (so they can share a batch); `ShuttingDown` once closed."""
        with self._ready:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            self._rows.extend(rows)
            self._ready.notify()

    def take(self, max_batch_size: int, max_out_tokens: int, timeout: float) -> list[Row]:
        """The next batch, waiting up to `timeout` seconds for one; empty if none came."""
        with self._ready:
            if not self._rows:
                self._ready.wait(timeout)
            return take_batch(self._rows, max_batch_size, max_out_tokens)

    def close(self) -> list[Row]:
        """Refuse new rows; the rows still queued (the caller fails their futures)."""
        with self._ready:
            self._closed = True
            left, self._rows = self._rows, []
            return left
