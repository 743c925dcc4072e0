"""bench/kv_index.py's short run: the index of KV events stays under its budget while fed past it, and still finds
the prompt a worker holds."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

from kv_index import run  # noqa: E402


def test_a_short_run_stays_under_its_budget_and_finds_the_held_prompt() -> None:
    result = run(blocks=50_000, workers=4, block_size=16, budget=2_000_000, prompt_tokens=1024)
    assert result["blocks_fed"] >= 50_000
    assert result["index_bytes"] <= 2_000_000  # type: ignore[operator]
    assert result["blocks_forgotten"] > 0  # type: ignore[operator]
    assert result["events_per_s"] > 0 and result["lookup_us"] > 0  # type: ignore[operator]
