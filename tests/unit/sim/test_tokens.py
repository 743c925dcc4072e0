"""Unit tests of the character-level tokens, pseudo-text and stop-string matching."""

from __future__ import annotations

import itertools

from smg_sim.tokens import StopMatcher, decode, encode, prompt_seed, pseudo_text


def test_one_token_per_character_round_trip() -> None:
    text = "héllo, 世界!"
    assert len(encode(text)) == len(text)
    assert decode(encode(text)) == text


def test_pseudo_text_is_deterministic_per_prompt() -> None:
    a = "".join(itertools.islice(pseudo_text(prompt_seed(encode("prompt A"))), 200))
    a2 = "".join(itertools.islice(pseudo_text(prompt_seed(encode("prompt A"))), 200))
    b = "".join(itertools.islice(pseudo_text(prompt_seed(encode("prompt B"))), 200))
    assert a == a2
    assert a != b
    assert " " in a and a.replace(" ", "").isalpha()


def feed_all(matcher: StopMatcher, text: str) -> tuple[str, str | None]:
    out = []
    for ch in text:
        released, matched = matcher.feed(ch)
        out.append(released)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


def test_stop_string_is_found_and_excluded() -> None:
    assert feed_all(StopMatcher(["cache"]), "warm cache prefix") == ("warm ", "cache")


def test_partial_stop_prefix_is_held_then_released() -> None:
    matcher = StopMatcher(["abc"])
    assert matcher.feed("x") == ("x", None)
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("b") == ("", None)
    assert matcher.feed("d") == ("abd", None)


def test_no_stop_strings_pass_through() -> None:
    assert feed_all(StopMatcher([]), "anything") == ("anything", None)
    assert feed_all(StopMatcher(["zz"]), "abc z") == ("abc z", None)
