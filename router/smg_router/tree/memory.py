"""What a radix tree costs in memory: a linear estimate calibrated with tracemalloc on CPython 3.11.

Counted per tree, from figures the tree keeps up to date (O(tenants) to read):

* ``NODE_BYTES`` per node: the slotted node object (GC header included), its tenant map and children
  dict (empty for a leaf, a small table otherwise), the edge string's header and its share of the tick
  ints (one per insert, shared by the nodes of its path);
* one byte per char of every edge, plus ``wide``: what non-ASCII edges cost beyond that (CPython keeps
  1, 2 or 4 bytes per char by the widest char of the string, measured exactly with ``sys.getsizeof``);
* ``ENTRY_BYTES`` per (node, tenant) entry beyond the first of each node: the tenant maps grow with the
  number of workers sharing a node;
* the reverse indexes (and the graves of removed tenants) exactly, by ``sys.getsizeof``: a dict keeps
  its table after deletions, so this stays honest after an eviction.

Calibration (tests/unit/tree/test_memory_estimate.py checks it): trees of several shapes are built under
tracemalloc and the traced growth is compared with the estimate. What tracemalloc does not see (the
allocator rounding every block up to 8 bytes, and arenas that are only partly used after nodes are
freed) makes the process's RSS somewhat larger than the estimate: leave room for it in the budget.
"""

from __future__ import annotations

__all__ = ["ENTRY_BYTES", "NODE_BYTES", "TREE_BYTES", "estimate_bytes"]

NODE_BYTES = 500
ENTRY_BYTES = 80
TREE_BYTES = 1024
"""A tree with nothing in it: the tree object, its root and its empty dicts."""


def estimate_bytes(*, nodes: int, chars: int, wide: int, entries: int, index_bytes: int) -> int:
    """Estimated bytes of a tree with these figures (see the module docstring)."""
    return TREE_BYTES + NODE_BYTES * nodes + chars + wide + ENTRY_BYTES * max(0, entries - nodes) + index_bytes
