"""The cache index seam: what a policy knows of the prompts each worker holds in its KV cache.

The cache-aware policy asks, per model, the index of each worker for a prompt's matched prefix, and tells that
index where the prompt was sent.  ``tree.RadixTree`` is one implementation, an approximate one: the router's memory
of what it sent (and, with peers, of what its replicas sent), evicted by the engines' KV capacity.  An index fed by
an engine's own KV events is another.  A fleet may mix them: ``deepest`` asks each index once and keeps the
deepest match.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from smg_router.tree import Match

NO_MATCH = Match(0, frozenset())


class CacheIndex(Protocol):
    """One model's prompts as a set of workers (tenants, by URL) hold them."""

    def match(self, text: str) -> Match:
        """The longest prefix of ``text`` any tenant holds, and the tenants that hold all of it."""
        ...

    def insert(self, text: str, tenant: str) -> None:
        """``text`` was sent to ``tenant``: its engine caches it now (or will, when its prefill is done)."""
        ...

    def tenant_size(self, tenant: str) -> int:
        """Chars the tenant holds by this index: what room it has left under its KV capacity."""
        ...


def deepest(text: str, indexes: Iterable[CacheIndex]) -> Match:
    """The deepest match of ``text`` over ``indexes``, with the tenants of every index that match that deep."""
    best = NO_MATCH
    for index in indexes:
        found = index.match(text)
        if found.matched_chars > best.matched_chars:
            best = found
        elif found.matched_chars and found.matched_chars == best.matched_chars:
            best = Match(best.matched_chars, best.tenants | found.tenants)
    return best
