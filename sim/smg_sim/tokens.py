"""Byte-level "tokenizer" and deterministic output text of the simulated engine.

One token is one byte of the text's UTF-8 encoding (ids 0-255), so ASCII text has one token per character,
and any prefix of the text is a prefix of the tokens. That keeps prefix caching exact and easy to reason
about in tests (a router's cache-aware policy, which works on text, sees the same prefixes the engine
does), and a real tokenizer reproduces it: the ``tokenizer/`` files shipped with the package (written by
``tokenizer_files``) make HuggingFace ``tokenizers`` give the same ids, so a router that tokenizes, or
follows the engine's KV events, sees the sim's very tokens. Output is ASCII: each decode step emits one
character (one token) of a pseudo-text seeded from the prompt, so identical prompts produce identical
completions and a multi-turn conversation that echoes the previous answer re-hits the cache.
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


#: What a token outside the byte range decodes to: U+FFFD, as an undecodable byte does.
_REPLACEMENT = "\ufffd".encode()


def encode(text: str) -> list[int]:
    """Tokens of `text`: its UTF-8 bytes (an unpaired surrogate, which UTF-8 cannot hold, becomes "?")."""
    return list(text.encode("utf-8", errors="replace"))


def decode(tokens: Sequence[int]) -> str:
    """Inverse of `encode`; bytes that are not valid UTF-8, and tokens outside 0-255, are shown as U+FFFD."""
    try:
        raw = bytes(tokens)
    except ValueError:
        raw = b"".join(bytes((t,)) if 0 <= t <= 255 else _REPLACEMENT for t in tokens)
    return raw.decode("utf-8", errors="replace")


def _byte_symbols() -> tuple[str, ...]:
    """GPT-2's byte-to-character table (HF's ``bytes_to_unicode``): printable Latin-1 bytes stand for
    themselves, the others for U+0100 onwards, so every byte has a visible one-character name."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(extra)
            extra += 1
    return tuple(symbols[b] for b in range(256))


#: The name of each token as a byte-level tokenizer spells it (`tokenizer.json`'s vocabulary, vLLM's token_strs).
BYTE_SYMBOLS = _byte_symbols()


def token_str(token: int) -> str:
    """What a byte-level tokenizer calls `token` (``convert_ids_to_tokens``), e.g. "Ġ" for a space."""
    return BYTE_SYMBOLS[token] if 0 <= token <= 255 else "\ufffd"


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
