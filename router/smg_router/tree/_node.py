"""The radix tree's node and its string helpers (private to the tree package)."""

from __future__ import annotations

import sys

_ASCII_HEADER = sys.getsizeof("")
"""Bytes of an empty ASCII ``str``; an ASCII edge of n chars costs this + n."""


class Node:
    __slots__ = ("children", "edge", "parent", "seq", "tenants")

    def __init__(self, edge: str, parent: Node | None, seq: int, tenants: dict[str, int]) -> None:
        self.edge = edge
        self.parent = parent  # None for the root and for detached (dead or orphaned) nodes
        self.seq = seq
        self.tenants = tenants
        self.children: dict[str, Node] = {}

    def __repr__(self) -> str:  # debugging aid only
        return f"Node({self.edge!r}, tenants={self.tenants!r}, children={len(self.children)})"


def wide_bytes(s: str) -> int:
    """Bytes ``s`` costs beyond an ASCII string of the same length (0 for ASCII; O(1)).

    CPython stores a string with 1, 2 or 4 bytes per char by its widest char (and a larger header when
    it is not ASCII), so a CJK or emoji edge costs 2-4 times an English one.
    """
    if s.isascii():
        return 0
    return sys.getsizeof(s) - _ASCII_HEADER - len(s)


def common_prefix_len(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[pos:]``.

    Precondition: ``edge[0] == text[pos]`` (children are keyed by first char) and ``edge`` is not a
    full prefix of ``text[pos:]``. Gallops (chunks of 8, 64, 512, ... chars compared by ``startswith``)
    to the window holding the first mismatch, then binary-searches it: about 4 C-level comparisons for
    a mismatch in the first 8 chars, about 16 for one 4000 chars in; never a Python per-char loop.
    """
    lo = 1  # edge[:lo] is known to match
    hi = len(text) - pos
    elen = len(edge)
    if hi >= elen:
        hi = elen - 1  # the full edge is known not to match
    elif text.startswith(edge[:hi], pos):
        return hi  # text exhausted inside the edge: one comparison
    step = 8
    while True:
        probe = lo + step
        if probe >= hi:
            break
        if text.startswith(edge[lo:probe], pos + lo):
            lo = probe
            step <<= 3
        else:
            hi = probe - 1
            break
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if text.startswith(edge[lo:mid], pos + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo
