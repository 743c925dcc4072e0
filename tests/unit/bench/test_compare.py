"""bench/routing/compare.py: before and after over seeds, and what counts as worse."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "routing"))

from compare import collect, kept, main, table  # noqa: E402


def _row(target: str, replicas: int, cached: float, p99: float, workload: str = "w") -> dict[str, object]:
    return {
        "workload": workload,
        "target": target,
        "replicas": replicas,
        "metrics": {"ok": 10, "cached_share": cached, "ttft_ms": {"p99": p99}},
    }


def test_a_cell_is_worse_only_past_the_seeds_spread(tmp_path: Path, capsys) -> None:
    rows = [
        # seeds of the before: cached 0.80 and 0.90 (spread 0.10), p99 100 and 110
        _row("smg:x@old", 1, 0.80, 100),
        _row("smg:x@old", 1, 0.90, 110),
        _row("smg:x@new", 1, 0.76, 105),  # 0.76 < 0.85 - 0.10: worse
        _row("smg:x@new", 1, 0.74, 300),  # p99 mean 202 > 105 + 195 (its own spread)? no: not worse
        _row("smg:x@old", 4, 0.80, 100),
        _row("smg:x@new", 4, 0.80, 200),  # one seed each: TTFT 200 > 100 + 5%: worse
        _row("smg:x@new", 4, 0.10, 1, workload="other"),  # no before: not compared
        {**_row("smg:x@new", 8, 0.0, 0), "metrics": {"ok": 0}},  # nothing answered: left out
    ]
    before, after = collect(rows, "old"), collect(rows, "new")
    assert set(after) == {("w", "smg:x", 1), ("w", "smg:x", 4), ("other", "smg:x", 4)}
    lines = table(before, after)
    one = next(line for line in lines if "| 1 |" in line)
    four = next(line for line in lines if "| 4 |" in line)
    assert one.endswith("| cached worse |") and "0.850 ±0.100" in one
    assert four.endswith("| TTFT worse |")
    assert not any("other" in line for line in lines)
    assert kept(before) == ["w smg:x: 4: 0.94"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows}))
    assert main([str(path), "--before", "old", "--after", "new"]) == 0
    assert "cached worse" in capsys.readouterr().out
