"""Where the router's CPU goes per request: py-spy samples of smg-router under wrk load, in buckets.

Usage (from the repository root, with the project's venv, which ``scripts/setup.sh`` gives py-spy; root or
ptrace rights to attach):
    .venv/bin/python bench/profile_proxy.py [--policy cache_aware] [--endpoint chat] [--stream]
        [--concurrency 64] [--duration 15] [--rate 100] [--router-commit REV] [--raw FILE] [--out FILE]

The setup of bench/bench_proxy.py (two smg-sim workers and the router on core 1, wrk on core 0, every router
default on).  First one unprofiled wrk run (the throughput to compare with), then ``py-spy record --native
--format raw`` of the router process (py-spy on core 0) during a second run.  py-spy drops idle samples (the
loop waiting in epoll), so the shares are of the router's busy time.  Each sample goes to one bucket:

- ``GC`` when any frame is the collector (``gc_collect_main``);
- otherwise the leaf-most frame that belongs to one of the code buckets (server = ``server.py`` and
  ``wire.py``, or aiohttp and its C parser, multidict/yarl for a router before 11a28ee; body parse =
  ``request.py`` and orjson; policy; tree; metrics = ``metrics.py`` and prometheus_client; upstream client =
  ``upstream/``; relay = ``relay.py``; router core = the rest of smg_router), so a socket write, an allocation
  or a parse by httptools (which both legs use) is charged to the code that asked for it;
- otherwise ``event loop`` (uvloop/libuv, asyncio and its C module: scheduling tasks, reading sockets
  before a protocol sees the bytes), else ``other``.
py-spy pauses the process for each sample (its default), which slows it down: compare shares, not speed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import bench_proxy as bp
from fleet import router_code, stop_all
from support.procs import Proc, Router

BUCKETS = (
    "server",
    "body parse",
    "policy",
    "tree",
    "metrics",
    "upstream client",
    "relay",
    "router core",
    "event loop",
    "GC",
    "other",
)
CODE_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("metrics", r"smg_router/metrics\.py|/prometheus_client/"),
        ("tree", r"smg_router/tree/"),
        ("policy", r"smg_router/polic(ies/|y_names)"),
        ("body parse", r"smg_router/request\.py|/orjson/"),
        ("upstream client", r"smg_router/upstream/"),
        ("relay", r"smg_router/relay\.py"),
        ("server", r"smg_router/(server|wire)\.py|/aiohttp/|/multidict/|/yarl/|/propcache/"),
        ("router core", r"smg_router/"),
    )
)
LOOP_RULE = re.compile(r"uvloop|libuv|/asyncio/|_asynciomodule")
GC_RULE = re.compile(r"^(gc_collect|collect_generations|_PyGC_Collect)")
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*)\)$")


def frames(stack: str) -> list[tuple[str, str]]:
    """(function, file) of each frame of a py-spy raw line's stack, root first."""
    out = []
    for part in stack.split(";"):
        m = FRAME.match(part)
        out.append((m["func"], m["file"]) if m else (part, ""))
    return out


def bucket(stack: Sequence[tuple[str, str]]) -> str:
    """The bucket of one sample (rules in the module docstring)."""
    if any(GC_RULE.match(func) for func, _ in stack):
        return "GC"
    for _func, file in reversed(_under_loop(stack)):
        for name, rule in CODE_RULES:
            if rule.search(file):
                return name
    if any(LOOP_RULE.search(file) or LOOP_RULE.search(func) for func, file in stack):
        return "event loop"
    return "other"


def aggregate(lines: Iterable[str]) -> tuple[collections.Counter[str], dict[str, collections.Counter[str]]]:
    """Samples per bucket, and per bucket the samples of each leaf-most frame that decided it (for reading)."""
    shares: collections.Counter[str] = collections.Counter()
    tops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        fs = frames(stack)
        name = bucket(fs)
        shares[name] += int(count)
        tops[name][_decider(fs, name)] += int(count)
    return shares, tops


def _under_loop(stack: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    """The frames the event loop runs: not ``__main__`` and the rest of the start-up that called the loop."""
    for i, (func, file) in enumerate(stack):
        if LOOP_RULE.search(file) or LOOP_RULE.search(func):
            return stack[i:]
    return stack


def _decider(stack: Sequence[tuple[str, str]], name: str) -> str:
    for func, file in reversed(_under_loop(stack)):
        if name == "GC" and GC_RULE.match(func):
            return func
        if any(n == name and rule.search(file) for n, rule in CODE_RULES):
            return f"{func} ({_short(file)})"
    func, file = stack[-1]
    return f"{func} ({_short(file)})"


def _short(file: str) -> str:
    for marker in ("site-packages/", "smg_router/", "lib/python3.11/", "Python-3.11.7/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file.rsplit("/", 1)[-1]


def table(shares: collections.Counter[str]) -> str:
    total = sum(shares.values()) or 1
    rows = ["| bucket | samples | share |", "| --- | --- | --- |"]
    rows += [f"| {b} | {shares[b]} | {shares[b] / total:.1%} |" for b in BUCKETS]
    rows.append(f"| total | {total} | |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--endpoint", default="chat", choices=("chat", "generate"))
    p.add_argument("--stream", action="store_true")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=int, default=15, help="seconds profiled")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--router-commit", help="profile smg-router as of this git revision (default: the working tree)")
    p.add_argument("--raw", type=Path, help="keep py-spy's raw (folded) samples here")
    p.add_argument(
        "--out",
        type=Path,
        default=bp.ROOT / "bench" / "out" / "profile.json",
        help="the shares and top frames as JSON (git ignores bench/out)",
    )
    args = p.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(spy, os.X_OK) or not shutil.which("wrk"):
        sys.exit("profile_proxy: needs py-spy (scripts/setup.sh) and wrk (scripts/install-test-tools.sh)")
    logs = Path(tempfile.mkdtemp(prefix="profile-proxy-"))
    raw = args.raw or logs / "py-spy.txt"
    cell = bp.Cell(args.endpoint, args.stream, args.concurrency)
    pythonpath = router_code(args.router_commit, logs) if args.router_commit else None
    procs: list[Proc] = []
    try:
        os.sched_setaffinity(0, {bp.SUT_CORE})
        sims = bp.start_sims(logs, 2)
        procs += sims
        router = bp.start_router(logs, f"smg:{args.policy}", [s.url for s in sims], rust_bin="", pythonpath=pythonpath)
        procs.append(router)
        os.sched_setaffinity(0, {bp.LOAD_CORE})
        assert router.popen is not None
        bp.wrk(router.url, cell, 2, "warm")
        plain = bp.wrk(router.url, cell, args.duration, "plain")
        record = [
            *(["taskset", "-c", str(bp.LOAD_CORE)] if shutil.which("taskset") else []),
            *(spy, "record", "--pid", str(router.popen.pid), "--native", "--format", "raw", "--full-filenames"),
            *("--rate", str(args.rate), "--duration", str(args.duration), "--output", str(raw)),
        ]
        profiled: dict[str, Any] = {}
        load = threading.Thread(target=lambda: profiled.update(bp.wrk(router.url, cell, args.duration + 2, "prof")))
        load.start()
        subprocess.run(record, check=True, capture_output=True)
        load.join()
    finally:
        stop_all([p for p in procs if isinstance(p, Router)], kill=True)
        stop_all([p for p in procs if not isinstance(p, Router)])
    shares, tops = aggregate(raw.read_text().splitlines())
    shutil.rmtree(logs, ignore_errors=True)  # the processes' logs, and the samples unless --raw put them elsewhere
    rps = {k: s["requests"] / (s["duration_us"] / 1e6) for k, s in (("plain", plain), ("profiled", profiled))}
    if args.out:
        doc = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": bp.git("rev-parse", "HEAD"),
            "router_commit": bp.git("rev-parse", args.router_commit) if args.router_commit else None,
            "cell": {"policy": args.policy, "endpoint": cell.endpoint, "stream": cell.stream, "c": cell.concurrency},
            "rps": rps,
            "samples": dict(shares),
            "top_frames": {b: tops[b].most_common(15) for b in BUCKETS if tops.get(b)},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"smg:{args.policy}, {cell.label}, c={cell.concurrency}: {rps['plain']:.0f} req/s unprofiled, "
        f"{rps['profiled']:.0f} req/s while sampled at {args.rate} Hz for {args.duration} s"
    )
    print(table(shares))
    for b in BUCKETS:
        if tops.get(b):
            print(f"\n{b}: " + "; ".join(f"{f} {n}" for f, n in tops[b].most_common(6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
