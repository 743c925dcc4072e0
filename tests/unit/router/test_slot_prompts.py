"""What a llama.cpp engine's slots hold, by what was sent it (``policies.slots``)."""

from __future__ import annotations

from smg_router.policies.slots import SlotPrompts, shared_chars


def test_shared_chars_is_the_common_prefix_length() -> None:
    assert shared_chars("abcdef", "abcxyz") == 3
    assert shared_chars("abc", "abcdef") == 3
    assert shared_chars("", "abc") == 0
    assert shared_chars("x" * 1000 + "a", "x" * 1000 + "b") == 1000


def test_a_prompt_alike_takes_its_slot_and_another_the_least_recently_used() -> None:
    doc_a, doc_b, doc_c = ("doc a " + "a" * 200), ("doc b " + "b" * 200), ("doc c " + "c" * 200)
    slots = SlotPrompts()
    slots.sent(doc_a + " q1", 2)
    slots.sent(doc_a + " q2", 2)  # the same group: its slot, not the other one
    assert len(slots) == 1 and slots.room(doc_b, 2)
    slots.sent(doc_b + " q1", 2)
    assert slots.holds(doc_a + " q3", len(doc_a)) and slots.holds(doc_b + " q2", len(doc_b))
    assert not slots.room(doc_c, 2) and slots.room(doc_a + " q4", 2)  # full, but a prompt alike has its slot
    slots.sent(doc_a + " q5", 2)  # a refreshed: b is now the least recently used
    slots.sent(doc_c + " q1", 2)
    assert slots.holds(doc_a, len(doc_a)) and slots.holds(doc_c, len(doc_c))
    assert not slots.holds(doc_b + " q3", len(doc_b))  # its slot went to c


def test_a_slot_holds_a_prompt_only_as_far_as_it_shares_it() -> None:
    slots = SlotPrompts()
    slots.sent("system prompt " * 20 + "conversation one", 1)
    asked = "system prompt " * 20 + "conversation two"
    assert slots.holds(asked, len("system prompt " * 20))  # the shared part is there
    assert not slots.holds(asked, len(asked))
    slots.sent(asked, 1)  # alike: the same slot, now with the second conversation
    assert len(slots) == 1 and slots.holds(asked, len(asked))
    slots.fit(0)
    assert len(slots) == 0
