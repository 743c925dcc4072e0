"""What the slots of an engine that keeps one prompt per slot hold (llama.cpp), by what the router sent it.

llama.cpp gives a request the idle slot whose cached prompt shares the most with it, when that is more than a tenth
of the request (its ``--slot-prompt-similarity``), else its least recently used slot; the slot then caches the
request's prompt.  So its slots hold the last prompts of as many groups as it has slots, a group being prompts alike
from their start.  ``SlotPrompts`` keeps those prompts' leading chars (each request's placement key text), most
recent last, the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

SIMILAR = 0.1
"""The share of a request's chars a slot's prompt must have in common with it to be given it: llama.cpp's default
``--slot-prompt-similarity``."""


def shared_chars(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (slices compared in halves: C-speed compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotPrompts:
    """The leading chars of the prompt in each of one engine's slots, least recently sent first."""

    __slots__ = ("_texts",)

    def __init__(self) -> None:
        self._texts: list[str] = []

    def __len__(self) -> int:
        return len(self._texts)

    def _alike(self, text: str, length: int) -> int:
        """The slot the engine would give a prompt of ``length`` chars that starts with ``text``: of those whose
        prompt shares more than ``SIMILAR`` of it, or the whole of ``text`` (the leading chars are all that is kept:
        a longer prompt with the same ones is of the same group), the one sharing the most; -1 for none."""
        head = text[: int(SIMILAR * length) + 1]  # what a prompt alike starts with (all of ``text`` when shorter)
        best, at = -1, -1
        for i, held in enumerate(self._texts):
            if held.startswith(head):  # C-speed: most slots hold another group, which fails at once
                n = shared_chars(held, text)
                if n > best:
                    best, at = n, i
        return at

    def sent(self, text: str, length: int, slots: int) -> None:
        """A request of ``length`` chars starting with ``text`` went: it takes the slot of a prompt alike, else the
        least recently used one."""
        at = self._alike(text, length)
        if at >= 0:
            del self._texts[at]
        self._texts.append(text)
        self.fit(slots)

    def fit(self, slots: int) -> None:
        """Keep the last ``slots`` prompts (the engine's slots became known, or fewer than were assumed)."""
        del self._texts[: max(0, len(self._texts) - slots)]

    def holds(self, text: str, chars: int) -> bool:
        """Whether a slot's prompt shares at least ``chars`` of ``text``'s leading chars."""
        head = text[:chars]
        return any(held.startswith(head) for held in self._texts)

    def evicts(self, text: str, length: int, slots: int) -> str | None:
        """The leading chars of the prompt a request of ``length`` chars starting with ``text`` would evict: None
        when a slot is free or holds one alike, else the least recently used slot's."""
        if len(self._texts) < slots or self._alike(text, length) >= 0:
            return None
        return self._texts[0]


def held_twice(engines: Iterable[SlotPrompts]) -> set[str]:
    """The prompts (leading chars) that the slots of two or more of these engines hold: copies, one of which can go
    without losing its group."""
    seen: set[str] = set()
    twice: set[str] = set()
    for engine in engines:
        for text in set(engine._texts):
            (twice if text in seen else seen).add(text)
    return twice
