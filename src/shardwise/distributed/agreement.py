"""Refusing to start when ranks disagree: compare a fingerprint across ranks, name the first difference.

A rank started with another config or model does not fail by itself: it issues other collectives (or the
same ones with other sizes) and the job hangs, or trains on silently wrong numbers. So before the first
collective that depends on them, every rank exchanges a fingerprint: a few named `Section`s, each an
ordered mapping of entry → value. The exchange is one all-gather of a 16-byte digest per section; only when
digests differ do rank 0 and the first rank that differs from it send the entries of the first section in
which they differ (a big model's names and shapes travel only then), so that every rank raises the same
`RankMismatchError` naming the entry, its two values and the two ranks.

What goes into the sections is the caller's business (`runtime/rank_fingerprint.py`); this module knows
nothing of configs or models.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from .collectives import Collectives
from .topology import Group

DIGEST_BYTES = 16
MAX_LISTED = 5
"""Entries listed when one rank has entries the other lacks."""

Value = str | dict[str, str]
"""An entry's value: a text, or named attributes ("shape", "dtype", ...) compared one by one."""


class RankMismatchError(ValueError):
    """Ranks started with different configs, models, optimizer groups or launch environments; raised on
    every rank alike, before any collective that would hang on the difference."""


@dataclass(frozen=True)
class Section:
    name: str
    """What it covers, as the message names it: "config", "parameters", ..."""
    entries: dict[str, Value]
    fix: str
    """How to make the ranks agree: the last sentence of the error."""
    label: str = "{}"
    """How one entry's key reads in the message, e.g. "parameter '{}'"."""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        text = json.dumps(list(self.entries.items()), separators=(",", ":"))
        object.__setattr__(self, "digest", hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest())


def check_agreement(sections: list[Section], comm: Collectives, group: Group, device: torch.device) -> None:
    """Collective over `group`: return if every rank has the same sections, else raise `RankMismatchError`
    on every rank. Every rank must pass the same number of sections, in the same order."""
    if group.size == 1:
        return
    mine = torch.frombuffer(bytearray(b"".join(s.digest for s in sections)), dtype=torch.uint8).to(device)
    everyone = torch.empty(group.size * mine.numel(), dtype=torch.uint8, device=device)
    comm.all_gather(everyone, mine, group).wait()
    digests = everyone.view(group.size, len(sections), DIGEST_BYTES).cpu()
    differs = [[not torch.equal(digests[r, i], digests[0, i]) for i in range(len(sections))] for r in range(group.size)]
    odd = [r for r in range(group.size) if any(differs[r])]
    if not odd:
        return
    first = odd[0]
    index = differs[first].index(True)
    section = sections[index]
    theirs = _exchange(section.entries if group.rank in (0, first) else None, (0, first), comm, group, device)
    detail = first_difference(section, theirs[0], theirs[1], first)
    others = [f"{r} ({', '.join(s.name for s, d in zip(sections, differs[r]) if d)})" for r in odd[1:]]
    also = f" Ranks that differ from rank 0 too: {', '.join(others)}." if others else ""
    raise RankMismatchError(
        f"{section.name}: every rank must start with the same; rank {first} differs from rank 0: {detail}. "
        f"{section.fix}{also}"
    )


def _exchange(entries: dict[str, Value] | None, sources: tuple[int, int], comm: Collectives, group: Group,
              device: torch.device) -> list[dict[str, Value]]:
    """Every rank receives the entries of the two `sources` (group ranks), which alone send them."""
    received = []
    for src in sources:
        payload = json.dumps(list(entries.items())).encode() if group.rank == src and entries is not None else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        comm.broadcast(size, src, group).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        if group.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        comm.broadcast(data, src, group).wait()
        received.append(dict(json.loads(bytes(data.cpu().numpy()).decode())))
    return received


def first_difference(section: Section, ours: dict[str, Value], theirs: dict[str, Value], rank: int) -> str:
    """The first entry (in rank 0's order) whose value differs, or the entries one side lacks."""
    for key, value in ours.items():
        if key in theirs and theirs[key] != value:
            return f"{section.label.format(key)}: {_values(value, theirs[key], rank)}"
    extra = [k for k in theirs if k not in ours]
    lacking = [k for k in ours if k not in theirs]
    parts = []
    if extra:
        parts.append(f"rank {rank} has {section.name} rank 0 lacks: {_listed(extra)}")
    if lacking:
        parts.append(f"rank {rank} lacks {section.name} rank 0 has: {_listed(lacking)}")
    if parts:
        return "; ".join(parts)
    position, (key0, key1) = next((i, pair) for i, pair in enumerate(zip(ours, theirs)) if pair[0] != pair[1])
    return (f"the same {section.name} in another order: {section.label.format(key0)} on rank 0, "
            f"{section.label.format(key1)} on rank {rank} at position {position}")


def _values(ours: Value, theirs: Value, rank: int) -> str:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for attribute in [*ours, *(k for k in theirs if k not in ours)]:
            if ours.get(attribute) != theirs.get(attribute):
                return f"{attribute} {ours.get(attribute, '(none)')} on rank 0, {theirs.get(attribute, '(none)')} on rank {rank}"
    return f"{ours} on rank 0, {theirs} on rank {rank}"


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return ", ".join(repr(k) for k in keys[:MAX_LISTED]) + more
