"""The prefix cache seen as engines announce it: full blocks of ``block_size`` tokens, each named by a chained hash.

`BlockTracker` is the `PrefixCache`'s observer behind the KV-event publisher (`kv_events`).  A path of the cache
holds block ``k`` (tokens ``[k*B, (k+1)*B)``) once it holds ``(k+1)*B`` tokens; the block's hash is a 64-bit
blake2b of its parent block's hash and its token ids, so equal hashes mean equal prefixes, as in vLLM's and
SGLang's own chained block hashes.  Only full blocks are announced, as engines announce them: a path's trailing
partial block is never stored, and evicting a leaf removes each block whose last token it held (which includes
a block it cuts into).  The events of a cache call are `Stored` (one run of new full blocks of one path, its
parent hash and its tokens), `Removed` and `Cleared`, handed to ``sink`` in order.

Pure: no sockets, no clock; the tracker keeps no state of its own (hashes are recomputed along a path).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BlockTracker", "Cleared", "KvEvent", "Removed", "Stored", "block_hashes"]


@dataclass(frozen=True, slots=True)
class Stored:
    """Full blocks newly cached, a run along one path: ``token_ids`` is ``len(block_hashes) * block_size`` long."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    """Full blocks that left the cache."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block left the cache."""


KvEvent = Stored | Removed | Cleared


def _block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" * 8 if parent is None else b"\x01" + parent.to_bytes(8, "big"))
    try:
        h.update(array("q", tokens).tobytes())
    except OverflowError:  # token ids beyond 64 bits: still a deterministic name
        h.update(repr(tuple(tokens)).encode())
    return int.from_bytes(h.digest(), "big")


def block_hashes(tokens: Sequence[int], block_size: int, count: int | None = None) -> list[int]:
    """Chained hashes of the first ``count`` full blocks of ``tokens`` (all of them by default)."""
    n = len(tokens) // block_size if count is None else count
    hashes: list[int] = []
    parent: int | None = None
    for k in range(n):
        parent = _block_hash(parent, tokens[k * block_size : (k + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockTracker:
    """A `CacheObserver` that turns the cache's changes into full-block events, handed to ``sink``."""

    __slots__ = ("block_size", "sink")

    def __init__(self, *, block_size: int, sink: Callable[[KvEvent], None]) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.sink = sink

    def added(self, path: Sequence[int], start: int) -> None:
        size = self.block_size
        first, end = start // size, len(path) // size  # blocks first..end-1 end after `start`
        if first >= end:
            return
        hashes = block_hashes(path, size, end)
        self.sink(
            Stored(
                block_hashes=tuple(hashes[first:]),
                parent_block_hash=hashes[first - 1] if first else None,
                token_ids=tuple(path[first * size : end * size]),
                block_size=size,
            )
        )

    def evicted(self, path: Sequence[int], start: int) -> None:
        size = self.block_size
        first, end = start // size, len(path) // size
        if first < end:
            self.sink(Removed(tuple(block_hashes(path, size, end)[first:])))

    def cleared(self) -> None:
        self.sink(Cleared())
