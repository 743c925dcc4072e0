"""tree: pure, synchronous, no I/O."""

from .radix_tree import Match, RadixTree

__all__ = ["Match", "RadixTree"]
