"""The figures of one benchmark cell (target x replicas x load) from its outcomes, and the Markdown table.

Times are converted to simulated time (wall / ``time_scale``), the unit of the sim's cost model, so figures
from runs at different ``--time-scale`` compare; the routers' own overhead is scaled up by the same factor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from loadgen import LoadSamples, Outcome
from oracle import oracle_cached
from workloads import PlannedRequest


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def load_spread(samples: LoadSamples, *, workers: int) -> dict[str, Any]:
    """Max/mean over workers of each worker's time-averaged running (and running + waiting) requests."""
    if not samples.running:
        return {"running_max_over_mean": None, "outstanding_max_over_mean": None, "mean_running": []}
    n = len(samples.running)
    running = [sum(row[w] for row in samples.running) / n for w in range(workers)]
    outstanding = [running[w] + sum(row[w] for row in samples.waiting) / n for w in range(workers)]

    def ratio(xs: list[float]) -> float | None:
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean > 0 else None

    return {
        "running_max_over_mean": ratio(running),
        "outstanding_max_over_mean": ratio(outstanding),
        "mean_running": [round(x, 3) for x in running],
        "mean_waiting": [round(o - r, 3) for o, r in zip(outstanding, running, strict=True)],
        "samples": n,
    }


def summarise(
    plan: Sequence[PlannedRequest],
    outcomes: Sequence[Outcome],
    samples: LoadSamples,
    *,
    time_scale: float,
    workers: int,
) -> dict[str, Any]:
    """Every figure of one cell."""
    by_index = {r.index: r for r in plan}
    ok = [o for o in outcomes if o.error is None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    sent = sorted(outcomes, key=lambda o: o.sent)
    oracle = oracle_cached((by_index[o.index].prompt, by_index[o.index].answer) for o in sent)
    oracle_prompt = sum(len(by_index[o.index].prompt) for o in sent)
    scale = 1.0 / time_scale
    ttft = [(o.first - o.sent) * scale * 1000.0 for o in ok if o.first is not None]
    span = (max(o.done for o in outcomes) - min(o.arrival for o in outcomes)) * scale if outcomes else 0.0
    served = Counter(o.worker for o in ok)
    errors = Counter((o.error or "")[:80] for o in outcomes if o.error is not None)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_kinds": dict(errors),
        "answer_mismatches": sum(1 for o in ok if not o.answer_ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else None,
        "oracle_share": sum(oracle) / oracle_prompt if oracle_prompt else None,
        "prompt_tokens_mismatches": sum(1 for o in ok if o.prompt_tokens != len(by_index[o.index].prompt)),
        "ttft_ms": {
            "p50": percentile(ttft, 0.5),
            "p90": percentile(ttft, 0.9),
            "p99": percentile(ttft, 0.99),
            "max": max(ttft, default=None),
        },
        "throughput_rps": len(ok) / span if span > 0 else None,
        "span_s": span,
        "send_lag_ms_p99": percentile([(o.sent - o.arrival) * scale * 1000.0 for o in outcomes], 0.99),
        "requests_per_worker": dict(sorted((k or "?", v) for k, v in served.items())),
        "workers_per_prefix": workers_per_prefix(plan, ok),
        "load": load_spread(samples, workers=workers),
    }


PREFIX_KEY_CHARS = 200
"""Requests whose prompts share this many leading chars count as one group in ``workers_per_prefix``."""


def workers_per_prefix(plan: Sequence[PlannedRequest], ok: Sequence[Outcome]) -> float | None:
    """Mean number of distinct workers that served a group (prompts sharing their first ``PREFIX_KEY_CHARS``),
    over the groups of two requests or more: 1.0 when every group stayed on one worker, more when a group was
    copied into several caches.  None when no group has two requests (unique prompts)."""
    by_index = {r.index: r for r in plan}
    groups: dict[str, list[str | None]] = {}
    for o in ok:
        groups.setdefault(by_index[o.index].prompt[:PREFIX_KEY_CHARS], []).append(o.worker)
    spread = [len(set(ws)) for ws in groups.values() if len(ws) > 1]
    return sum(spread) / len(spread) if spread else None


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One line per cell."""
    head = (
        "| workload | target | replicas | load | cached share | oracle | TTFT p50 ms | p90 ms | p99 ms "
        "| req/s (offered) | spread max/mean | errors |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        m = r["metrics"]
        t = m["ttft_ms"]
        lines.append(
            f"| {r['workload']} | {r['target']} | {r['replicas']} | {r['load']:.2f} "
            f"| {_f(m['cached_share'], '.3f')} | {_f(m['oracle_share'], '.3f')} "
            f"| {_f(t['p50'], '.0f')} | {_f(t['p90'], '.0f')} | {_f(t['p99'], '.0f')} "
            f"| {_f(m['throughput_rps'], '.2f')} ({r['offered_rps']:.2f}) "
            f"| {_f(m['load']['running_max_over_mean'], '.2f')} | {m['errors']} |"
        )
    return "\n".join(lines)


def pivot(rows: Sequence[dict[str, Any]]) -> str:
    """Cached share by target (rows) and replicas (columns), one block per workload and load: the headline table."""
    out: list[str] = []
    keys = sorted({(r["workload"], r["load"]) for r in rows})
    for workload, load in keys:
        cell = [r for r in rows if r["workload"] == workload and r["load"] == load]
        reps = sorted({r["replicas"] for r in cell})
        targets = list(dict.fromkeys(r["target"] for r in cell))
        oracle = [r["metrics"]["oracle_share"] for r in cell if r["metrics"]["oracle_share"] is not None]
        oracle_txt = f", oracle {min(oracle):.2f}" + (
            f"-{max(oracle):.2f}" if max(oracle) - min(oracle) > 0.005 else ""
        )
        out.append(f"\n{workload}, load {load:.2f} (cached share{oracle_txt if oracle else ''})\n")
        out.append("| target | " + " | ".join(f"{n} replica{'s' if n > 1 else ''}" for n in reps) + " |")
        out.append("| --- |" + " --- |" * len(reps))
        for t in targets:
            vals = []
            for n in reps:
                got = [r["metrics"]["cached_share"] for r in cell if r["target"] == t and r["replicas"] == n]
                vals.append(_f(got[0], ".3f") if got else "")
            out.append(f"| {t} | " + " | ".join(vals) + " |")
    return "\n".join(out)
