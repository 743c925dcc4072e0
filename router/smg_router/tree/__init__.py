"""tree: pure, synchronous, no I/O."""

from .eviction import Eviction
from .radix_tree import Match, RadixTree
from .upkeep import Limits, Upkeep, share_budget

__all__ = ["Eviction", "Limits", "Match", "RadixTree", "Upkeep", "share_budget"]
