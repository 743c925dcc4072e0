"""PNG plots of a routing benchmark result (the JSON of ``run.py``); needs matplotlib.

Usage:  python bench/routing/plot.py RESULT.json [OUT_DIR]

Per workload: cached share against router replicas (one panel per load, the oracle dashed), and TTFT p99
against load (one panel per replica count).  Importing this module fails without matplotlib, which run.py
takes as "no plots".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib  # type: ignore[import-not-found, unused-ignore]

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]


def _panels(count: int) -> tuple[Any, Sequence[Any]]:
    fig, axes = plt.subplots(1, count, figsize=(4.2 * count, 3.6), squeeze=False, sharey=True)
    return fig, list(axes[0])


def plot_all(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the plots of every workload in ``result``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = result["rows"]
    paths: list[Path] = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        targets = list(dict.fromkeys(r["target"] for r in mine))
        loads = sorted({r["load"] for r in mine})
        reps = sorted({r["replicas"] for r in mine})

        fig, axes = _panels(len(loads))
        for ax, load in zip(axes, loads, strict=True):
            cell = [r for r in mine if r["load"] == load]
            for t in targets:
                pts = sorted((r["replicas"], r["metrics"]["cached_share"]) for r in cell if r["target"] == t)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=t)
            oracle = [r["metrics"]["oracle_share"] for r in cell if r["metrics"]["oracle_share"] is not None]
            if oracle:
                ax.axhline(max(oracle), linestyle="--", color="grey", label="oracle")
            ax.set_xscale("log", base=2)
            ax.set_xticks(reps, [str(n) for n in reps])
            ax.set_ylim(0, 1)
            ax.set_title(f"{workload}, load {load:.2f}")
            ax.set_xlabel("router replicas")
        axes[0].set_ylabel("cached-token share")
        axes[-1].legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{workload}_cached_share.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

        fig, axes = _panels(len(reps))
        for ax, n in zip(axes, reps, strict=True):
            cell = [r for r in mine if r["replicas"] == n]
            for t in targets:
                pts = sorted((r["load"], r["metrics"]["ttft_ms"]["p99"]) for r in cell if r["target"] == t)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=t)
            ax.set_title(f"{workload}, {n} replica{'s' if n > 1 else ''}")
            ax.set_xlabel("load (fraction of capacity)")
        axes[0].set_ylabel("TTFT p99 (simulated ms)")
        axes[-1].legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{workload}_ttft_p99.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    result = json.loads(Path(argv[1]).read_text())
    out = Path(argv[2]) if len(argv) > 2 else Path(argv[1]).parent
    for p in plot_all(result, out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
