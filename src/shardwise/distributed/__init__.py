"""Process groups, the rendezvous environment and the collectives choke point."""

from .collectives import Collectives, CollectiveError, CollectiveTimeout, CommStats
from .init import init_distributed
from .topology import Group, Topology

__all__ = ["Collectives", "CollectiveError", "CollectiveTimeout", "CommStats", "Group", "Topology", "init_distributed"]
