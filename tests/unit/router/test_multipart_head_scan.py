"""The multipart head scan fed piece by piece (``upload.HeadScanner``): the same fields and end as a scan of the
whole prefix, whatever the pieces, and a cost that grows with the head, not with its square."""

from __future__ import annotations

import random
import time

import pytest
from smg_router.upload import HeadScanner, scan_head

B = b"XyZ"


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    extra = f'; filename="{filename}"' if filename else ""
    return b"--" + B + f'\r\nContent-Disposition: form-data; name="{name}"{extra}\r\n\r\n'.encode() + value + b"\r\n"


def _fields_head(size: int) -> bytes:
    """Small fields, one after another, up to ``size`` bytes (no file part: the head never ends)."""
    return b"".join(_part(f"f{i}", b"v%d" % i) for i in range(size // 40 + 1))[:size]


FORMS = [
    _part("model", b"whisper") + _part("stream", b"true") + _part("file", b"\x00" * 50, "a.wav") + b"--" + B + b"--",
    b"preamble\r\n" + _part("model", b"m\r\n--X") + b"--" + B + b"--\r\n",
    _part("file", b"abc", "a.wav") + _part("model", b"m"),
    _part("model", b"m") + _part("upload", b"x", "model"),
    _fields_head(2000),
]


@pytest.mark.parametrize("form", FORMS, ids=range(len(FORMS)))
@pytest.mark.parametrize("seed", range(4))
def test_pieces_give_what_a_scan_of_the_whole_prefix_gives(form: bytes, seed: int) -> None:
    rng = random.Random(seed)
    scanner, at = HeadScanner(B), 0
    while at < len(form):
        piece = form[at : at + rng.choice((1, 2, 3, 5, 8, 64))]
        at += len(piece)
        done = scanner.feed(piece)
        assert (scanner.fields, done) == scan_head(form[:at], B), at
        if done:
            break
    assert bytes(scanner.buf) == form[:at]


def test_a_64_kib_head_in_4_byte_pieces_costs_milliseconds() -> None:
    """A scan of everything so far at every piece took seconds for this head in 64-byte pieces (~1,600 fields
    parsed again at each of ~1,000 pieces); fed piece by piece it is one pass."""
    head = _fields_head(64 * 1024)
    started = time.process_time()
    scanner = HeadScanner(B)
    for at in range(0, len(head), 4):
        assert not scanner.feed(head[at : at + 4])
    spent = time.process_time() - started
    assert len(scanner.fields) > 1000
    assert spent < 0.5, f"{spent:.3f} s of CPU for 16,384 pieces"
