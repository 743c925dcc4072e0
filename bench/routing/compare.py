"""Side by side: the cells of an A/B run of ``run.py`` over several fleets, one line per arm.

Usage (from the repository root): ``.venv/bin/python bench/routing/compare.py DIR base,new`` reads
``DIR/<arm>-f<fleet>.json`` (one file per arm and fleet seed: bench/routing/README.md, "Comparing two commits") and
prints, per (workload, target, replicas, load), each arm's cached share / TTFT p99 ms on every fleet and their means.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def compare(folder: Path, arms: list[str]) -> str:
    cells: dict[tuple[str, str, int, float], dict[str, list[tuple[str, float, float]]]] = {}
    for arm in arms:
        for path in sorted(folder.glob(f"{arm}-f*.json")):
            fleet = path.stem.rpartition("-f")[2]
            for row in json.loads(path.read_text())["rows"]:
                m = row["metrics"]
                key = (row["workload"], row["target"], row["replicas"], row["load"])
                cells.setdefault(key, {}).setdefault(arm, []).append((fleet, m["cached_share"], m["ttft_ms"]["p99"]))
    lines = []
    for (workload, target, replicas, load), by_arm in sorted(cells.items()):
        lines.append(f"{workload} {target} x{replicas} load {load}")
        for arm, xs in by_arm.items():
            each = ", ".join(f"f{f} {c:.3f}/{p:.0f}" for f, c, p in xs)
            mean_c, mean_p = sum(x[1] for x in xs) / len(xs), sum(x[2] for x in xs) / len(xs)
            lines.append(f"  {arm:8s} {each} | mean {mean_c:.3f}/{mean_p:.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: compare.py DIR ARM,ARM,...")
    print(compare(Path(sys.argv[1]), sys.argv[2].split(",")))
