"""The cache index seam: what a policy knows of the prompts each worker holds in its KV cache.

The cache-aware policy asks, per model, the index of each worker for a prompt's matched prefix, and tells that
index where the prompt was sent.  ``tree.RadixTree`` is one implementation, an approximate one: the router's memory
of what it sent (and, with peers, of what its replicas sent), evicted by the engines' KV capacity.  An index fed by
an engine's own KV events is another.  A fleet may mix them: ``deepest`` asks each index once and keeps the
deepest match.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from smg_router.tree import Match
from smg_router.tree.blocks import BlockIndex

NO_MATCH = Match(0, frozenset())


class CacheIndex(Protocol):
    """One model's prompts as a set of workers (tenants, by URL) hold them.  A prompt is its routing text and,
    when the router knows them, the token ids of the engine's prompt (``prompts``) in their namespace
    (``tree.blocks.namespace_of``): an index keys one or the other."""

    def match(self, text: str, tokens: Sequence[int] | None = None, namespace: str = "") -> Match:
        """The longest prefix of the prompt any tenant holds (in chars of ``text``), and the tenants that hold all
        of it."""
        ...

    def insert(self, text: str, tenant: str, tokens: Sequence[int] | None = None, namespace: str = "") -> None:
        """The prompt was sent to ``tenant``: its engine caches it now (or will, when its prefill is done)."""
        ...

    def tenant_size(self, tenant: str, *, shared: bool = False) -> int:
        """Chars the tenant holds by this index: what room it has left under its KV capacity.  ``shared``: only what
        every replica sees alike (an index of the engines' events leaves this process's guesses out)."""
        ...


def deepest(text: str, tokens: Sequence[int] | None, indexes: Iterable[CacheIndex], namespace: str = "") -> Match:
    """The deepest match of the prompt over ``indexes``, with the tenants of every index that match that deep."""
    best = NO_MATCH
    for index in indexes:
        found = index.match(text, tokens, namespace)
        if found.matched_chars > best.matched_chars:
            best = found
        elif found.matched_chars and found.matched_chars == best.matched_chars:
            best = Match(best.matched_chars, best.tenants | found.tenants)
    return best


class EventIndex:
    """The workers of one model whose engines publish KV events: what those events say they hold
    (``tree.blocks.BlockIndex``), behind the seam.

    A match is in tokens; the policy reads chars of the routing text, so the matched share of the prompt's tokens is
    given as the same share of its text.  A prompt without tokens matches nothing here.  ``insert`` records the
    decision as speculative blocks (``BlockIndex.speculate``) until the engine's own events say it.
    """

    def __init__(
        self, blocks: BlockIndex, *, chars_per_token: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.blocks = blocks
        self._chars_per_token = chars_per_token
        self._clock = clock

    def match(self, text: str, tokens: Sequence[int] | None = None, namespace: str = "") -> Match:
        if not tokens:
            return NO_MATCH
        held = self.blocks.match(tokens, namespace, now=self._clock())
        if not held:
            return NO_MATCH
        deepest = max(held.values())
        tenants = frozenset(url for url, n in held.items() if n == deepest)
        return Match(len(text) * min(deepest, len(tokens)) // len(tokens), tenants)

    def insert(self, text: str, tenant: str, tokens: Sequence[int] | None = None, namespace: str = "") -> None:
        if tokens:
            self.blocks.speculate(tenant, tokens, self._clock(), namespace)

    def full(self, tenant: str) -> bool:
        """Whether the worker's engine has no free KV: it evicted blocks since its cache was last empty.  Its cached
        blocks may then be fewer than its capacity (a busy engine evicts for its running requests, which hold the
        rest), so ``tenant_size`` alone would show a busy engine as the one with room."""
        return self.blocks.full(tenant)

    def tenant_size(self, tenant: str, *, shared: bool = False) -> int:
        """The chars the worker's blocks stand for (tokens times the chars per token of the KV cap): those its engine
        said it holds, and, unless ``shared``, those this process sent it since (its speculative ones)."""
        blocks = self.blocks.blocks_of(tenant, speculative=not shared, now=self._clock())
        return int(blocks * self.blocks.block_size_of(tenant) * self._chars_per_token)


class EventIndexes:
    """Which workers are matched by their engines' KV events: one ``BlockIndex`` per model, shared by every policy
    instance and fed by the subscribers (``kv_events``).  A worker is, once it was given an event source, the router
    can tokenize its model's prompts (without a prompt's tokens its events could match nothing), and its events are
    known whole.

    A worker whose stream lost batches (``lost``) is not known whole: its entry is emptied and it is matched in the
    approximate tree until its entry equals its engine's cache again: when the engine says its cache is empty
    (``emptied``: a clear, a restart) or once it has stored, since the loss, as many tokens as its KV cache holds
    (``learned``): every block it held then has been evicted or stored again, but for those kept by cache hits,
    which publish nothing.  Its events are applied meanwhile, so the blocks they name are matched all along."""

    def __init__(
        self,
        *,
        budget_bytes: int,
        chars_per_token: float,
        tokenized: frozenset[str] = frozenset(),
        spec_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spec_seconds = spec_seconds
        self._clock = clock
        self._budget = budget_bytes
        self._chars_per_token = chars_per_token
        self.tokenized = tokenized
        """Models whose prompts the router tokenizes (``--tokenizer``)."""
        self._models: dict[str, EventIndex] = {}
        self._workers: dict[str, str] = {}
        """worker url -> model, of the workers given an event source"""
        self._learning: dict[str, int] = {}
        """worker url -> tokens its engine stored since its stream lost batches, of the workers not known whole"""

    def blocks(self, model: str) -> BlockIndex:
        """The model's block index (made on first use)."""
        return self._index(model).blocks

    def _index(self, model: str) -> EventIndex:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = EventIndex(
                BlockIndex(budget_bytes=self._budget, spec_seconds=self._spec_seconds),
                chars_per_token=self._chars_per_token,
                clock=self._clock,
            )
        return found

    def publishes(self, worker_url: str, model: str) -> None:
        """The worker's engine publishes KV events (a subscriber applies them to ``blocks(model)``)."""
        self._workers[worker_url] = model
        self._index(model)

    def forget(self, worker_url: str) -> None:
        """The worker left, or its events stopped: what they said goes with it."""
        model = self._workers.pop(worker_url, None)
        self._learning.pop(worker_url, None)
        if model is not None:
            self._models[model].blocks.cleared(worker_url)

    def lost(self, worker_url: str) -> None:
        """The worker's stream lost batches: its entry may name blocks its engine evicted, so it is emptied, and the
        worker is matched in the tree until it is known whole again."""
        model = self._workers.get(worker_url)
        if model is not None:
            self._models[model].blocks.cleared(worker_url)
            self._learning[worker_url] = 0

    def emptied(self, worker_url: str) -> bool:
        """The worker's engine said its cache is empty (a clear, a restart): its entry is emptied and equals it.
        True when that made the worker known whole again."""
        model = self._workers.get(worker_url)
        if model is not None:
            self._models[model].blocks.cleared(worker_url)
        return self._learning.pop(worker_url, None) is not None

    def learned(self, worker_url: str, tokens: int, capacity: int | None) -> bool:
        """The worker's engine stored ``tokens`` more; True when that made it known whole again (it has stored its
        KV ``capacity`` in tokens since the loss; an unknown capacity waits for ``emptied``)."""
        so_far = self._learning.get(worker_url)
        if so_far is None:
            return False
        so_far += tokens
        if capacity is None or so_far < capacity:
            self._learning[worker_url] = so_far
            return False
        del self._learning[worker_url]
        return True

    def known_whole(self, worker_url: str) -> bool:
        """Whether the worker's entry follows its engine's every event since the entry was last empty."""
        return worker_url in self._workers and worker_url not in self._learning

    def index_of(self, worker_url: str) -> CacheIndex | None:
        """The worker's own index when it is matched by events, else None (the approximate tree)."""
        model = self._workers.get(worker_url)
        if model is None or model not in self.tokenized or worker_url in self._learning:
            return None
        return self._models[model]

    def models(self) -> dict[str, BlockIndex]:
        return {model: index.blocks for model, index in self._models.items()}
