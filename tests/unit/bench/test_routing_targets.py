"""The routing benchmark's targets: ``smg:<policy>[+peers][~VARIANT]``, a variant adding its flags to every replica,
so that the arms of a comparison run side by side in one run (same machine state, targets innermost)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "routing"))

from fleet import Launch, Target, parse_variants


def test_a_variant_adds_its_flags_after_the_common_ones_and_names_the_target() -> None:
    variants = parse_variants(["nohold=--prefill-hold-seconds 0", 'quoted=--model-alias "a b"'])
    t = Target.parse("smg:cache_aware+peers~nohold", variants)
    assert (t.name, t.peers, t.flags) == ("smg:cache_aware+peers~nohold", True, ("--prefill-hold-seconds", "0"))
    argv = Launch(t, ["http://w:1"], 0.25, smg_args=["--cache-threshold", "0.5"]).argv(9000, peers=[9001])
    assert argv[-6:] == ["--peer", "http://127.0.0.1:9001", "--cache-threshold", "0.5", "--prefill-hold-seconds", "0"]
    assert Target.parse("rust:cache_aware~quoted", variants).flags == ("--model-alias", "a b")


def test_a_target_without_a_variant_keeps_its_name_and_flags() -> None:
    t = Target.parse("smg:round_robin")
    assert (t.name, t.peers, t.variant, t.flags) == ("smg:round_robin", False, "", ())


@pytest.mark.parametrize("text", ["smg:cache_aware~missing", "rust:cache_aware+peers", "smg", "other:rr"])
def test_a_malformed_target_or_unknown_variant_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Target.parse(text, parse_variants(["known=--x 1"]))
