"""The soak benchmark's short version: ~50 s at 80% of a 4-worker fleet's measured capacity, a worker killed and
restarted every 15 s.  Asserts what bench/soak.py reports for the 10-minute run (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(240)
def test_a_short_soak_loses_nothing_and_holds_its_memory() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--duration",
            "50",
            "--kill-every",
            "15",
            "--warmup",
            "15",
            "--calibrate",
            "5",
            "--tree-memory-budget",
            str(2**20),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kills"] >= 3
    assert result["json_ok"] > 300 and result["streams_done"] > 300, result
    assert result["json_lost_count"] == 0, result["json_lost"]
    assert result["streams_lost_count"] == 0, result["streams_lost"]  # each ended with [DONE] (maybe after an error)
    assert result["rss_growth"] < 0.10, result["rss_mb_per_second"]
    assert result["max_loop_lag_s"] <= 0.25, result
