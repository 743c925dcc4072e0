"""Benchmark results stay out of git: runs write to the ignored ``bench/out/``, the repository keeps small summaries.

``bench/summarize.py`` turns a whole result into the summary ``docs/benchmarks.md`` quotes; ``bench/routing/plot.py``
redraws the routing plots from it, so a summary must keep every field the plots read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
SUMMARIES = ROOT / "bench" / "summaries"
sys.path.insert(0, str(ROOT / "bench"))

from summarize import summarize  # noqa: E402

MAX_SUMMARY_BYTES = 100_000


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_no_tracked_file_lies_under_a_results_or_out_folder() -> None:
    offenders = [p for p in _tracked() if {"results", "out"} & set(Path(p).parts[:-1])]
    assert offenders == []


def test_bench_out_is_ignored_by_git() -> None:
    probe = "bench/out/routing/results.json"
    done = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    assert done.returncode == 0, f"{probe} is not ignored: benchmark output would show in git status"


@pytest.mark.parametrize("path", sorted(SUMMARIES.glob("*.json")), ids=lambda p: p.name)
def test_each_summary_is_small_and_names_its_run(path: Path) -> None:
    assert path.stat().st_size < MAX_SUMMARY_BYTES
    doc = json.loads(path.read_text())
    runs = doc.get("runs", [doc])
    for run in runs:
        assert run["command"] and run["started"], "a figure without its command and date"
        assert run.get("commit") or run.get("head") or run.get("router_commit"), "a figure without its commit"


def test_the_summaries_cover_the_quoted_benchmarks() -> None:
    assert {p.stem for p in SUMMARIES.glob("*.json")} >= {"proxy", "routing", "llamacpp"}


def _routing_result() -> dict[str, Any]:
    metrics = {
        "requests": 10,
        "ok": 10,
        "errors": 0,
        "cached_share": 0.5,
        "oracle_share": 0.8,
        "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
        "per_worker": [{"worker": f"w{i}", "samples": list(range(1000))} for i in range(4)],
    }
    row = {"workload": "shared_prefix", "target": "smg:cache_aware", "replicas": 1, "load": 0.8, "metrics": metrics}
    return {"command": "run.py", "started": "2026-01-01T00:00:00Z", "head": "abc", "rows": [row], "failures": []}


def test_a_routing_summary_keeps_what_the_plots_read_and_drops_samples() -> None:
    doc = summarize("routing", [_routing_result()])
    (row,) = doc["rows"]
    cell = (row["workload"], row["target"], row["replicas"], row["load"])
    assert cell == ("shared_prefix", "smg:cache_aware", 1, 0.8)
    assert row["metrics"]["cached_share"] == 0.5
    assert row["metrics"]["oracle_share"] == 0.8
    assert row["metrics"]["ttft_ms"]["p99"] == 3.0
    assert "per_worker" not in row["metrics"]
    assert doc["command"] == "run.py" and doc["head"] == "abc"


def test_several_results_become_one_summary_with_numbered_runs() -> None:
    doc = summarize("routing", [_routing_result(), _routing_result()])
    assert [r["run"] for r in doc["rows"]] == [0, 1]
    assert [r["command"] for r in doc["runs"]] == ["run.py", "run.py"]


def test_a_summary_of_some_targets_keeps_only_their_rows(tmp_path: Path) -> None:
    result = _routing_result()
    result["rows"] += [{**result["rows"][0], "target": "smg:cache_aware+events"}, {**result["rows"][0], "target": "x"}]
    doc = summarize("compare", [result, result], targets=["smg:cache_aware", "x"])
    assert [(r["run"], r["target"]) for r in doc["rows"]] == [
        (0, "smg:cache_aware"),
        (0, "x"),
        (1, "smg:cache_aware"),
        (1, "x"),
    ]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    script = str(ROOT / "bench" / "summarize.py")
    argv = [sys.executable, script, "routing", "--targets", "smg:cache_aware+events", str(path)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert [r["target"] for r in json.loads(out)["rows"]] == ["smg:cache_aware+events"]


def test_a_proxy_summary_keeps_medians_and_spreads_not_runs() -> None:
    runs = [{"cpu_us": 100.0, "p99_ms": 9.0}, {"cpu_us": 120.0, "p99_ms": 7.0}, {"cpu_us": None, "p99_ms": 8.0}]
    cell = {
        "target": "smg:cache_aware",
        "endpoint": "chat",
        "stream": False,
        "concurrency": 64,
        "check": {"status": 200, "ok": True},
        "median": {"cpu_us": 110.0, "p50_ms": 1.0, "p99_ms": 8.0, "rps": 5.0},
        "added_p50_us": 250.0,
        "runs": runs,
    }
    doc = summarize("proxy", [{"command": "bench_proxy.py", "started": "t", "commit": "abc", "cells": [cell]}])
    (got,) = doc["cells"]
    assert got["cpu_us_spread"] == [100.0, 120.0]
    assert got["p99_ms_spread"] == [7.0, 9.0]
    assert got["median"]["cpu_us"] == 110.0 and got["added_p50_us"] == 250.0 and got["ok"] is True
    assert "runs" not in got


def test_a_soak_summary_keeps_one_row_per_run_without_the_rss_of_every_second() -> None:
    result = {
        "command": "bench/soak.py --duration 90 --hostile --json",
        "started": "2026-01-01T00:00:00Z",
        "commit": "abc",
        "legit_lost": 0,
        "rss_growth": 0.05,
        "loop_lag_p99_s": 0.01,
        "hostile": {"slow_statuses": {"408": 40}},
        "rss_mb_per_second": [40.0] * 600,
    }
    doc = summarize("soak", [result, {**result, "command": "bench/soak.py --duration 600 --hostile --json"}])
    assert [run["command"] for run in doc["runs"]] == [
        result["command"],
        "bench/soak.py --duration 600 --hostile --json",
    ]
    assert [row["run"] for row in doc["rows"]] == [0, 1]
    assert doc["rows"][0]["hostile"] == {"slow_statuses": {"408": 40}} and doc["rows"][0]["legit_lost"] == 0
    assert "rss_mb_per_second" not in doc["rows"][0]
