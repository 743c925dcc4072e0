"""Before and after: two router commits side by side over the seeds of one comparison run.

Usage:  python bench/routing/compare.py RESULT.json [RESULT.json ...] --before REV --after REV

Reads routing-benchmark results (``run.py``'s or ``llamacpp.py``'s output, or their summaries in
``bench/summaries/``) whose targets name their commits (``smg:cache_aware@REV``), and prints, per workload, arm
(the target without its ``@REV``) and replica count, the mean cached share and p99 latency (TTFT; end to end for
the llama.cpp benchmark, which has no TTFT) of each commit over the seeds, with the seeds' spread (max - min).  A
cell is marked ``worse`` when the after is below the before by more than the larger of the two spreads (cached
share; at least 0.005), or above it by more than that (p99; at least 5%).  Then, per arm of each commit, the cached
share with 4 and 8 replicas as a fraction of its 1-replica share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CACHED_FLOOR = 0.005
"""The least difference of cached share that counts (the figures are printed to three places)."""
TTFT_FLOOR = 0.05
"""The least relative difference of TTFT p99 that counts (one request more or less in the tail moves it more)."""

Cell = tuple[str, str, int]
"""(workload, arm, replicas)"""


def load_rows(paths: Sequence[Path]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows += json.loads(path.read_text())["rows"]
    return rows


def collect(rows: Sequence[dict[str, Any]], rev: str) -> dict[Cell, list[tuple[float, float]]]:
    """Cell -> (cached share, TTFT p99 ms) of every seed of the targets at ``rev`` (rows with no answer left out)."""
    out: dict[Cell, list[tuple[float, float]]] = {}
    for r in rows:
        arm, _, at = r["target"].partition("@")
        m = r["metrics"]
        if at != rev or not m.get("ok"):
            continue
        ttft = m.get("ttft_ms") or m.get("e2e_ms") or {}
        cell = (r.get("workload", "llamacpp"), arm, int(r["replicas"]))  # the llama.cpp benchmark has one workload
        out.setdefault(cell, []).append((m["cached_share"], ttft.get("p99", 0.0)))
    return out


def _mean_spread(xs: Sequence[float]) -> tuple[float, float]:
    return statistics.mean(xs), max(xs) - min(xs)


def table(before: dict[Cell, list[tuple[float, float]]], after: dict[Cell, list[tuple[float, float]]]) -> list[str]:
    lines = [
        "| workload | arm | replicas | cached before | cached after | p99 ms before | p99 ms after | |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in sorted(set(before) & set(after)):
        (cb, sb), (ca, sa) = (_mean_spread([c for c, _ in d[cell]]) for d in (before, after))
        (tb, ub), (ta, ua) = (_mean_spread([t for _, t in d[cell]]) for d in (before, after))
        worse = []
        if ca < cb - max(sb, sa, CACHED_FLOOR):
            worse.append("cached worse")
        if ta > tb + max(ub, ua, TTFT_FLOOR * tb):
            worse.append("TTFT worse")
        workload, arm, n = cell
        lines.append(
            f"| {workload} | {arm} | {n} | {cb:.3f} ±{sb:.3f} | {ca:.3f} ±{sa:.3f} | {tb:.0f} ±{ub:.0f} | "
            f"{ta:.0f} ±{ua:.0f} | {', '.join(worse)} |"
        )
    return lines


def kept(cells: dict[Cell, list[tuple[float, float]]]) -> list[str]:
    """Per workload and arm: the 4- and 8-replica cached share over the 1-replica one."""
    lines = []
    for workload, arm in sorted({(w, a) for w, a, _ in cells}):
        one = cells.get((workload, arm, 1))
        if not one:
            continue
        base = statistics.mean(c for c, _ in one)
        parts = []
        for n in (4, 8):
            xs = cells.get((workload, arm, n))
            if xs and base > 0:
                parts.append(f"{n}: {statistics.mean(c for c, _ in xs) / base:.2f}")
        lines.append(f"{workload} {arm}: " + ", ".join(parts))
    return lines


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--before", required=True, help="the @REV of the targets before")
    p.add_argument("--after", required=True, help="the @REV of the targets after")
    a = p.parse_args(argv)
    rows = load_rows(a.results)
    before, after = collect(rows, a.before), collect(rows, a.after)
    if not before or not after:
        p.error(f"no rows at @{a.before} or @{a.after}")
    print("\n".join(table(before, after)))
    for rev, cells in ((a.before, before), (a.after, after)):
        print(f"\nkept over 1 replica @{rev}:")
        print("\n".join(kept(cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
