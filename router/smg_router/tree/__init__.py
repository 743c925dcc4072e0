"""tree: pure, synchronous, no I/O."""

from .eviction import Eviction
from .radix_tree import Match, RadixTree

__all__ = ["Eviction", "Match", "RadixTree"]
