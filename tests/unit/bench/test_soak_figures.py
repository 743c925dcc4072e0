"""``bench/soak.py`` reads its figures from the router's ``/metrics``; ``bench/soak_hostile.py`` reads raw answers."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

from soak import loop_lag_quantile, max_loop_lag  # noqa: E402
from soak_hostile import read_response  # noqa: E402


def _lag(counts: dict[str, int]) -> str:
    return "".join(f'smg_event_loop_lag_seconds_bucket{{le="{le}"}} {n}\n' for le, n in counts.items())


def test_the_lag_p99_counts_only_the_samples_taken_between_two_expositions() -> None:
    before = _lag({"0.001": 10, "0.005": 10, "0.02": 10, "0.25": 12, "+Inf": 12})  # two slow ones at startup
    after = _lag({"0.001": 300, "0.005": 395, "0.02": 410, "0.25": 412, "+Inf": 412})
    assert loop_lag_quantile(before, after, 0.99) == 0.02
    assert loop_lag_quantile(after, after, 0.99) == 0.0
    assert max_loop_lag(after) == 0.25


def test_a_raw_answer_is_read_whole_with_its_status_and_whether_it_closes() -> None:
    async def read(raw: bytes) -> tuple[int, bool]:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await read_response(reader)

    assert asyncio.run(read(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")) == (
        408,
        True,
    )
    assert asyncio.run(read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")) == (
        200,
        False,
    )
