"""The small summary of a benchmark result that the repository keeps (``bench/summaries/``).

Usage:  python bench/summarize.py KIND [--targets T1,T2,...] RESULT.json [RESULT.json ...] > bench/summaries/NAME.json
(KIND: proxy, epp, routing, llamacpp, compare or soak; ``--targets``: keep only the rows or cells of these targets,
so one run of several comparisons makes a summary per comparison, each small enough)

A benchmark writes its whole result to ``bench/out/`` (ignored by git): every repetition, every worker's samples.
``docs/benchmarks.md`` quotes a few figures of the latest run; the summary keeps exactly the figures a reader needs
to check the page and redraw its plots (``bench/routing/plot.py bench/summaries/routing.json DIR``), with the
command, commit, date and machine of the run.  Several results of one kind (e.g. two workloads of the routing
benchmark run as two commands) become one summary whose rows are concatenated.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

RUN_KEYS = (
    "command",
    "started",
    "commit",
    "head",
    "router_commit",
    "target_commits",
    "machine",
    "loadavg_before",
    "load_average",
)


def _run(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: doc[k] for k in RUN_KEYS if k in doc}


def _spread(runs: list[dict[str, Any]], key: str) -> list[float] | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return [min(values), max(values)] if values else None


def proxy(doc: dict[str, Any]) -> dict[str, Any]:
    """Per cell and target: the medians over the repetitions, the spread of CPU and p99, the added p50."""
    cells = [
        {
            **{k: c[k] for k in ("target", "endpoint", "stream", "concurrency")},
            "median": c["median"],
            "cpu_us_spread": _spread(c["runs"], "cpu_us"),
            "p99_ms_spread": _spread(c["runs"], "p99_ms"),
            "added_p50_us": c.get("added_p50_us"),
            "ok": c.get("check", {}).get("ok"),
        }
        for c in doc["cells"]
    ]
    return {**_run(doc), "settings": doc.get("settings"), "cells": cells}


METRIC_KEYS = (
    "requests",
    "ok",
    "errors",
    "cached_share",
    "oracle_share",
    "cached_over_oracle",
    "misses",
    "ttft_ms",
    "prefill_ms",
    "prefill_p90_over_p50",
    "e2e_ms",
    "throughput_rps",
    "spread_max_over_mean",
)


def routing(doc: dict[str, Any]) -> dict[str, Any]:
    """Per row (workload, target, replicas, load): the cache and latency figures, no per-worker samples."""
    rows = [
        {
            **{k: r[k] for k in ("workload", "target", "replicas", "load", "offered_rps") if k in r},
            "metrics": {k: r["metrics"][k] for k in METRIC_KEYS if k in r["metrics"]},
        }
        for r in doc["rows"]
    ]
    extra = {k: doc[k] for k in ("workloads", "lru_reference", "requests") if k in doc}
    return {**_run(doc), **extra, "rows": rows}


COMPARE_KEYS = ("ok", "errors", "cached_share", "ttft_ms", "e2e_ms")


def compare(doc: dict[str, Any]) -> dict[str, Any]:
    """A before/after comparison (``bench/routing/compare.py``): per row only what it reads, so that every seed of a
    large matrix fits."""
    full = routing(doc)
    for row in full["rows"]:
        row["metrics"] = {k: v for k, v in row["metrics"].items() if k in COMPARE_KEYS}
    return full


SOAK_KEYS = (
    "duration_s",
    "capacity_rps",
    "rate_rps",
    "sent",
    "json_ok",
    "streams_done",
    "streams_cut_with_error_event",
    "legit_lost",
    "kills",
    "rss_first",
    "rss_last",
    "rss_growth",
    "rss_window_s",
    "rss_first_window_median",
    "rss_last_window_median",
    "rss_growth_window",
    "max_loop_lag_s",
    "loop_lag_p99_s",
    "peer_records",
    "hostile",
)


def soak(doc: dict[str, Any]) -> dict[str, Any]:
    """One row per run of ``bench/soak.py --json``: what was lost, the memory and the event loop's lag, and what the
    hostile clients got; not the RSS of every second."""
    return {**_run(doc), "rows": [{k: doc[k] for k in SOAK_KEYS if k in doc}]}


KINDS = {"proxy": proxy, "epp": proxy, "routing": routing, "llamacpp": routing, "compare": compare, "soak": soak}


def summarize(kind: str, docs: Sequence[dict[str, Any]], *, targets: Sequence[str] = ()) -> dict[str, Any]:
    key = "cells" if kind in ("proxy", "epp") else "rows"
    parts = [KINDS[kind](d) for d in docs]
    if targets:
        parts = [{**p, key: [r for r in p[key] if r.get("target") in targets]} for p in parts]
    if len(parts) == 1:
        return parts[0]
    runs = [{k: v for k, v in p.items() if k != key} for p in parts]
    return {"runs": runs, key: [{"run": i, **r} for i, p in enumerate(parts) for r in p[key]]}


def main(argv: Sequence[str]) -> int:
    targets: list[str] = []
    if len(argv) > 2 and argv[1] == "--targets":
        targets, argv = argv[2].split(","), [argv[0], *argv[3:]]
    if len(argv) < 2 or argv[0] not in KINDS:
        print(__doc__, file=sys.stderr)
        return 2
    docs = []
    for path in argv[1:]:
        with open(path) as f:
            docs.append(json.load(f))
    print(dumps(summarize(argv[0], docs, targets=targets)))
    return 0


def dumps(doc: dict[str, Any]) -> str:
    """JSON with one line per row or cell (a diff then shows which figures moved), the rest indented."""
    parts = []
    for key, value in doc.items():
        if key in ("rows", "cells"):
            lines = ",\n  ".join(json.dumps(item, separators=(",", ":")) for item in value)
            parts.append(f"{json.dumps(key)}: [\n  {lines}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, indent=1)}")
    return "{\n " + ",\n ".join(parts) + "\n}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
