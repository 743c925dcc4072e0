"""The oracle of a request sequence: the prompt tokens an engine with unbounded KV could serve from its cache.

For each request in the order it was sent, the longest prefix its prompt shares with anything sent before it
(an earlier prompt followed by that request's answer: the sim caches both, so a chat turn's history hits),
capped at the prompt length minus one because an engine computes at least the last token (as the sim does).
One worker with infinite KV holding everything: no routing can do better, and requests in flight together
are counted as if each had waited for the other's prefill, so the oracle is an upper bound.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from smg_router.policies.slots import shared_chars as common_prefix_len


def oracle_cached(sequence: Iterable[tuple[str, str]]) -> list[int]:
    """Cached tokens per (prompt, answer) of ``sequence`` under the oracle.

    The string of a sorted set sharing the longest prefix with a query is next to the query's insertion point,
    so two comparisons per request suffice.
    """
    seen: list[str] = []
    out: list[int] = []
    for prompt, answer in sequence:
        i = bisect.bisect_left(seen, prompt)
        best = 0
        if i > 0:
            best = common_prefix_len(prompt, seen[i - 1])
        if i < len(seen):
            best = max(best, common_prefix_len(prompt, seen[i]))
        out.append(min(best, max(0, len(prompt) - 1)))
        bisect.insort(seen, prompt + answer)
    return out


def oracle_share(sequence: Iterable[tuple[str, str]]) -> float:
    """sum(oracle cached) / sum(prompt tokens) of ``sequence``."""
    items = list(sequence)
    total = sum(len(p) for p, _ in items)
    return sum(oracle_cached(items)) / total if total else 0.0
