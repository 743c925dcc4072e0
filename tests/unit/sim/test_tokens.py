"""Unit tests of the byte-level tokens, pseudo-text and stop-string matching."""

from __future__ import annotations

import itertools

from smg_sim.tokens import StopMatcher, decode, encode, prompt_seed, pseudo_text, token_str


def test_ascii_is_one_token_per_character() -> None:
    text = "hello, world! <|user|>\n"
    assert encode(text) == [ord(ch) for ch in text]
    assert decode(encode(text)) == text


def test_non_ascii_is_one_token_per_utf8_byte_and_round_trips() -> None:
    text = "héllo, 世界 \U0001f600"
    assert encode(text) == list(text.encode("utf-8"))
    assert len(encode("é")) == 2 and len(encode("世")) == 3 and len(encode("\U0001f600")) == 4
    assert decode(encode(text)) == text


def test_undecodable_bytes_and_out_of_range_tokens_decode_as_replacement_characters() -> None:
    assert decode([0xFF, ord("a")]) == "\ufffda"
    assert decode([ord("a"), 300, -1, ord("b")]) == "a\ufffd\ufffdb"
    assert decode(encode("é")[:1]) == "\ufffd"  # half of a character


def test_token_strs_are_the_byte_level_symbols() -> None:
    assert [token_str(t) for t in encode("a b\n")] == ["a", "Ġ", "b", "Ċ"]
    assert token_str(256) == "\ufffd"


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
