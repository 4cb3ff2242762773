"""Process groups, the rendezvous environment and the collectives choke point.

The names below load on first use (PEP 562): the launcher's rank bootstrap imports `parent_watchdog` from this
package before the user's script, and an eager import here would load torch into every rank, `exec` targets and
torch-free scripts included."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agreement import RankMismatchError
    from .collectives import Collectives, CollectiveError, CollectiveTimeout, CommStats
    from .init import init_distributed
    from .topology import Group, Topology

_HOMES = {"RankMismatchError": "agreement", "Collectives": "collectives", "CollectiveError": "collectives",
          "CollectiveTimeout": "collectives", "CommStats": "collectives", "init_distributed": "init",
          "Group": "topology", "Topology": "topology"}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
