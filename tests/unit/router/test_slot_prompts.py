"""What a llama.cpp engine's slots hold, by what was sent it (``policies.slots``)."""

from __future__ import annotations

from smg_router.policies.slots import SlotPrompts, held_twice, shared_chars


def test_shared_chars_is_the_common_prefix_length() -> None:
    assert shared_chars("abcdef", "abcxyz") == 3
    assert shared_chars("abc", "abcdef") == 3
    assert shared_chars("", "abc") == 0
    assert shared_chars("x" * 1000 + "a", "x" * 1000 + "b") == 1000


def test_a_prompt_alike_takes_its_slot_and_another_the_least_recently_used() -> None:
    doc_a, doc_b, doc_c = ("doc a " + "a" * 200), ("doc b " + "b" * 200), ("doc c " + "c" * 200)
    slots = SlotPrompts()
    slots.sent(doc_a + " q1", 209, 2)
    slots.sent(doc_a + " q2", 209, 2)  # the same group: its slot, not the other one
    assert len(slots) == 1 and slots.evicts(doc_b, 206, 2) is None  # a slot is free
    slots.sent(doc_b + " q1", 209, 2)
    assert slots.holds(doc_a + " q3", len(doc_a)) and slots.holds(doc_b + " q2", len(doc_b))
    assert slots.evicts(doc_c, 206, 2) == doc_a + " q2"  # full: the least recently used slot's prompt goes
    assert slots.evicts(doc_a + " q4", 209, 2) is None  # a prompt alike has its slot
    slots.sent(doc_a + " q5", 209, 2)  # a refreshed: b is now the least recently used
    slots.sent(doc_c + " q1", 209, 2)
    assert slots.holds(doc_a, len(doc_a)) and slots.holds(doc_c, len(doc_c))
    assert not slots.holds(doc_b + " q3", len(doc_b))  # its slot went to c


def test_a_slot_holds_a_prompt_only_as_far_as_it_shares_it() -> None:
    slots = SlotPrompts()
    slots.sent("system prompt " * 20 + "conversation one", 296, 1)
    asked = "system prompt " * 20 + "conversation two"
    assert slots.holds(asked, len("system prompt " * 20))  # the shared part is there
    assert not slots.holds(asked, len(asked))
    slots.sent(asked, len(asked), 1)  # alike: the same slot, now with the second conversation
    assert len(slots) == 1 and slots.holds(asked, len(asked))
    slots.fit(0)
    assert len(slots) == 0


def test_prompts_alike_are_judged_on_their_whole_length_not_their_leading_chars() -> None:
    """Only a prompt's leading chars are kept (its placement key text, 1024 at most): two long documents that share a
    preamble a tenth of those chars long are alike by them, but not by the prompts llama.cpp compares; and two
    questions on one long document share all the chars kept, however little that is of their length."""
    preamble = "Answer from the document below. " * 4  # 128 chars
    doc_a, doc_b = preamble + "a" * 896, preamble + "b" * 896  # the leading 1024 chars of 16k-char prompts
    slots = SlotPrompts()
    slots.sent(doc_a, 16_000, 2)
    slots.sent(doc_b, 16_000, 2)
    assert len(slots) == 2  # two slots: 128 of 16,000 chars in common is not alike
    slots.sent(doc_a, 16_400, 2)  # another question on a: the same leading chars, its slot
    assert len(slots) == 2 and slots.holds(doc_b, len(doc_b)) and slots.holds(doc_a, len(doc_a))


def test_a_prompt_in_the_slots_of_two_engines_is_held_twice() -> None:
    one, two, three = SlotPrompts(), SlotPrompts(), SlotPrompts()
    for engine, texts in ((one, ["doc a", "doc b"]), (two, ["doc a", "doc c"]), (three, ["doc c", "doc d"])):
        for t in texts:
            engine.sent(t, 100, 2)
    assert held_twice([one, two, three]) == {"doc a", "doc c"}
    assert held_twice([one, three]) == set()
