"""What the launcher tells every node agent, as one base64 JSON word (pure).

Passing the job as one ``[A-Za-z0-9+/=]`` word means the script's arguments — spaces, quotes, ``$``, ``;``
— never meet a remote shell: only this word, host names (validated) and env values (quoted) do.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Elastic:
    """``--elastic_training``: the agents' c10d rendezvous admits ``min_nodes..max_nodes`` and restarts."""

    min_nodes: int
    max_nodes: int
    max_restarts: int


@dataclass(frozen=True)
class JobSpec:
    nodes: tuple[tuple[str, tuple[int, ...]], ...]  # (host, slots) in node-rank order
    script: str
    script_args: tuple[str, ...]
    mode: str  # "path" | "module" | "exec" (see bootstrap.py)
    pass_local_rank: bool
    master_addr: str
    master_port: int
    run_id: str
    lifeline_port: int = 0
    lifeline_token: str = ""
    lifeline_addrs: dict[str, str] = field(default_factory=dict)  # host → the launcher's address seen from it
    elastic: Elastic | None = None
    each_rank_log: str | None = None
    pid_file: str | None = None

    def encode(self) -> str:
        return base64.b64encode(json.dumps(asdict(self), separators=(",", ":")).encode()).decode()

    @classmethod
    def decode(cls, word: str) -> JobSpec:
        raw: dict[str, Any] = json.loads(base64.b64decode(word.encode(), validate=True))
        raw["nodes"] = tuple((host, tuple(slots)) for host, slots in raw["nodes"])
        raw["script_args"] = tuple(raw["script_args"])
        raw["elastic"] = Elastic(**raw["elastic"]) if raw.get("elastic") else None
        return cls(**raw)

    def node_rank_of(self, host: str) -> int:
        hosts = [h for h, _ in self.nodes]
        if host not in hosts:
            raise ValueError(f"host {host!r} is not one of this job's nodes ({', '.join(hosts)}).")
        return hosts.index(host)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for _, slots in self.nodes)
