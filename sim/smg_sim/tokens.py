"""Character-level "tokenizer" and deterministic output text of the simulated engine.

One token is one Unicode character (its code point), so a prompt's length in tokens is its number of
characters, and any prefix of the text is a prefix of the tokens. That keeps prefix caching exact and
easy to reason about in tests (a router's cache-aware policy, which works on text, sees the same
prefixes the engine does). Output is made of characters too: each decode step emits one character of
a pseudo-text seeded from the prompt, so identical prompts produce identical completions and a
multi-turn conversation that echoes the previous answer re-hits the cache.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Iterator, Sequence

#: Words the pseudo-text is made of; lower-case ASCII so the output is easy to read in logs.
_WORDS = (
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "a",
    "worker",
    "with",
    "warm",
    "cache",
    "prefix",
    "tokens",
    "are",
    "reused",
    "when",
    "prompts",
    "share",
    "history",
    "load",
    "balance",
    "decode",
    "prefill",
    "batch",
    "queue",
    "model",
    "fast",
    "small",
    "quiet",
    "steady",
    "stream",
    "of",
    "and",
    "in",
    "on",
    "for",
    "kv",
    "simulated",
    "engine",
    "answers",
)


def encode(text: str) -> list[int]:
    """Tokens of `text`: one per character (its code point)."""
    return [ord(ch) for ch in text]


def decode(tokens: Sequence[int]) -> str:
    """Inverse of `encode`; tokens outside the Unicode range are shown as U+FFFD."""
    return "".join(chr(t) if 0 <= t <= 0x10FFFF else "\ufffd" for t in tokens)


def prompt_seed(tokens: Sequence[int]) -> int:
    """A stable 64-bit seed derived from the prompt, so output depends only on the prompt."""
    raw = array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def pseudo_text(seed: int) -> Iterator[str]:
    """An endless deterministic stream of characters forming words separated by spaces."""
    rng = random.Random(seed)
    first = True
    while True:
        word = rng.choice(_WORDS)
        if not first:
            yield " "
        first = False
        yield from word


class StopMatcher:
    """Finds stop strings in a character stream while holding back text that may start one.

    Engines never send a stop string (or the part of it generated so far) to the client, so text is
    released only once it can no longer be the beginning of a stop string.
    """

    __slots__ = ("_pending", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add generated text; return (text safe to release, matched stop string or None)."""
        if not self._stops:
            return text, None
        self._pending += text
        for stop in self._stops:
            idx = self._pending.find(stop)
            if idx >= 0:
                released = self._pending[:idx]
                self._pending = ""
                return released, stop
        keep = self._held_suffix_len()
        cut = len(self._pending) - keep
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released, None

    def flush(self) -> str:
        """Release whatever is held back (the generation ended without a match)."""
        released, self._pending = self._pending, ""
        return released

    def _held_suffix_len(self) -> int:
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if stop.startswith(self._pending[-k:]):
                    longest = k
                    break
        return longest
