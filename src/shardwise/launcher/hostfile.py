"""Hostfiles and resource filters (pure: no torch, no processes, no network).

A hostfile lists the machines of a job, DeepSpeed's format::

    # comment
    worker-1 slots=4
    worker-2 slots=4   # a trailing comment

``--include`` / ``--exclude`` take ``host[:slot,slot...]`` terms joined by ``@``
(``worker-1:0,1@worker-2``); ``--num_nodes`` keeps the first N hosts and ``--num_gpus`` the first G
slots of each. The result is an ordered tuple of :class:`Node` (host, slot indices): node ranks follow
hostfile order. Every error quotes what it read and says how to fix it.

Host names are checked against a conservative pattern because they end up in ssh/pdsh/mpirun command
lines: a name starting with ``-`` would be read as an option, and shell characters must never reach a
remote shell (see ``runners.py``, which also quotes everything).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import NoReturn

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default location, read when it exists

# RFC 1123 labels (plus "_", seen on real clusters) or an IPv4 address; never a leading "-" or ".".
_HOST_RE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?$")
_SLOTS_RE = re.compile(r"^slots=(\d+)$")


class HostfileError(ValueError):
    """A hostfile or a resource filter is wrong; the message quotes it and says how to fix it."""


@dataclass(frozen=True)
class Node:
    """One machine of the job and the slot (device) indices used on it."""

    host: str
    slots: tuple[int, ...]

    @property
    def nproc(self) -> int:
        return len(self.slots)


def check_host(host: str, where: str) -> str:
    """Return ``host`` if it is a plausible host name or IPv4 address; raise otherwise."""
    if not _HOST_RE.match(host) or ".." in host:
        raise HostfileError(
            f"{where}: host name {host!r} is not valid; use letters, digits, '-', '_' and '.' only "
            "(no leading '-' or '.', no spaces or shell characters)."
        )
    return host


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` in file order. Comments (``#``) and blank lines are skipped."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number} ({raw.strip()!r})"
        host, slots = _parse_line(line, where)
        if host in hosts:
            raise HostfileError(
                f"{where}: host {host!r} is listed twice (first on line {first_line[host]}); "
                "give each host one line with its total slots."
            )
        hosts[host], first_line[host] = slots, number
    if not hosts:
        raise HostfileError(f"{source}: no hosts found; expected lines like 'worker-1 slots=4'.")
    return hosts


def _parse_line(line: str, where: str) -> tuple[str, int]:
    fields = line.split()
    if len(fields) != 2:
        raise HostfileError(f"{where}: expected '<host> slots=<N>'; got {len(fields)} field(s).")
    host, slots_field = fields
    match = _SLOTS_RE.match(slots_field)
    if match is None:
        raise HostfileError(f"{where}: expected 'slots=<N>' after the host; got {slots_field!r}.")
    slots = int(match.group(1))
    if slots < 1:
        raise HostfileError(f"{where}: slots must be at least 1; got {slots}.")
    return check_host(host, where), slots


def read_hostfile(path: str) -> dict[str, int]:
    """Parse the hostfile at ``path``; a missing file is an error that names it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise HostfileError(f"--hostfile {path}: no such file (cwd {os.getcwd()}).") from None
    except OSError as error:
        raise HostfileError(f"--hostfile {path}: cannot be read ({error.strerror}).") from None
    return parse_hostfile(text, source=path)


def parse_filter(spec: str, option: str) -> dict[str, tuple[int, ...] | None]:
    """``"a:0,1@b"`` → ``{"a": (0, 1), "b": None}`` (``None``: every slot of the host)."""
    terms: dict[str, tuple[int, ...] | None] = {}
    for term in spec.split("@"):
        where = f"{option} {spec!r}: term {term!r}"
        host, sep, slot_text = term.partition(":")
        if not host:
            _fail(f"{where}: a host name is missing.")
        check_host(host, where)
        if host in terms:
            _fail(f"{where}: host {host!r} appears twice; list its slots once ('{host}:0,1').")
        terms[host] = _parse_slots(slot_text, where) if sep else None
    return terms


def _parse_slots(text: str, where: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not text or not all(p.isdigit() for p in parts):
        _fail(f"{where}: slots must be comma-separated numbers like 'host:0,1'; got {text!r}.")
    slots = tuple(int(p) for p in parts)
    if len(set(slots)) != len(slots):
        _fail(f"{where}: slot listed twice.")
    return slots


def _fail(message: str) -> NoReturn:
    raise HostfileError(message)


def _check_known(hosts: dict[str, int], terms: dict[str, tuple[int, ...] | None], option: str) -> None:
    for host, slots in terms.items():
        if host not in hosts:
            known = ", ".join(hosts)
            _fail(f"{option}: host {host!r} is not in the hostfile (hosts: {known}).")
        for slot in slots or ():
            if slot >= hosts[host]:
                _fail(f"{option}: host {host!r} has slots 0-{hosts[host] - 1}; there is no slot {slot}.")


def apply_filters(hosts: dict[str, int], include: str = "", exclude: str = "") -> tuple[Node, ...]:
    """The hosts and slots left after ``--include`` or ``--exclude`` (not both), in hostfile order."""
    if include and exclude:
        _fail("--include and --exclude cannot be used together; keep one.")
    option, spec = ("--include", include) if include else ("--exclude", exclude)
    terms = parse_filter(spec, option) if spec else {}
    _check_known(hosts, terms, option)
    chosen: dict[str, tuple[int, ...]] = {}
    for host, count in hosts.items():
        named = terms.get(host, ())
        every = tuple(range(count))
        if include:  # only named hosts; a host without a slot list keeps all its slots
            chosen[host] = every if named is None else named if host in terms else ()
        else:  # named hosts (or named slots of them) are dropped
            chosen[host] = () if named is None else tuple(s for s in every if s not in named)
    nodes = tuple(Node(h, tuple(sorted(s))) for h, s in chosen.items() if s)
    if not nodes:
        _fail(f"{option}: no slots are left on any host; nothing to run.")
    return nodes


def limit(nodes: tuple[Node, ...], num_nodes: int | None = None, num_slots: int | None = None) -> tuple[Node, ...]:
    """Keep the first ``num_nodes`` hosts and the first ``num_slots`` slots of each (``--num_gpus``)."""
    if num_nodes is not None:
        if not 1 <= num_nodes <= len(nodes):
            _fail(f"--num_nodes {num_nodes}: must be between 1 and the {len(nodes)} host(s) available.")
        nodes = nodes[:num_nodes]
    if num_slots is not None:
        short = [n.host for n in nodes if n.nproc < num_slots]
        if num_slots < 1 or short:
            _fail(f"--num_gpus {num_slots}: must be at least 1 and at most the slots of every host; "
                  f"too few on {', '.join(short) or '-'}.")
        nodes = tuple(Node(n.host, n.slots[:num_slots]) for n in nodes)
    return nodes


def select(
    hosts: dict[str, int],
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_slots: int | None = None,
) -> tuple[Node, ...]:
    """Hostfile entries → the job's nodes: filters first, then the node and slot limits."""
    return limit(apply_filters(hosts, include, exclude), num_nodes, num_slots)
