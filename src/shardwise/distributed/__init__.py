"""Process groups, the rendezvous environment and the collectives choke point."""

from .agreement import RankMismatchError
from .collectives import Collectives, CollectiveError, CollectiveTimeout, CommStats
from .init import init_distributed
from .topology import Group, Topology

__all__ = ["Collectives", "CollectiveError", "CollectiveTimeout", "CommStats", "Group", "RankMismatchError", "Topology",
           "init_distributed"]
