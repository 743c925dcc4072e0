"""Benchmark: what the router adds per request, side by side with a direct connection and the Rust `smg`.

Usage:  python bench/bench_proxy.py [--requests 3000] [--concurrency 1 32] [--rust [--rust-bin PATH]]

Starts two smg-sim workers (time scale 0: no simulated GPU time, so the proxy cost dominates), then for
each target (direct to a worker, smg-router, and with --rust the Rust gateway `smg` from PyPI if
installed) sends the same non-streaming completions (~1 KB bodies) at each concurrency from a load
generator pinned to core 0 (the targets are pinned to core 1).  Prints latency p50/p99, throughput and
the target's CPU time per request (router process only, from /proc), and ratios against the baselines
measured in the same run.  Numbers from a noisy 2-core machine: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import aiohttp

MODEL = "bench-model"
HZ = os.sysconf("SC_CLK_TCK")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ  # utime + stime


def spawn(args: list[str], core: int) -> subprocess.Popen[bytes]:
    taskset = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    return subprocess.Popen([*taskset, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@dataclass
class Result:
    name: str
    concurrency: int
    p50_ms: float
    p99_ms: float
    rps: float
    cpu_us: float | None


async def load(url: str, *, requests: int, concurrency: int, body: bytes) -> tuple[list[float], float]:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as s:
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                t0 = time.perf_counter()
                async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0


def measure(name: str, base: str, pid: int | None, args: argparse.Namespace) -> list[Result]:
    body = (b'{"model": "%s", "max_tokens": 1, "prompt": "' % MODEL.encode()) + b"x" * 1000 + b'"}'
    out = []
    for c in args.concurrency:
        asyncio.run(load(base + "/v1/completions", requests=min(200, args.requests), concurrency=c, body=body))
        cpu0 = cpu_seconds(pid) if pid else None
        lat, elapsed = asyncio.run(load(base + "/v1/completions", requests=args.requests, concurrency=c, body=body))
        cpu = (cpu_seconds(pid) - cpu0) / args.requests * 1e6 if pid and cpu0 is not None else None
        q = statistics.quantiles(lat, n=100)
        out.append(Result(name, c, q[49] * 1e3, q[98] * 1e3, args.requests / elapsed, cpu))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rust", action="store_true", help="also measure the Rust `smg` gateway (pip install smg)")
    p.add_argument("--rust-bin", default=shutil.which("smg"), help="path of the `smg` command (default: on PATH)")
    args = p.parse_args()
    os.sched_setaffinity(0, {0})  # the load generator on core 0
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sims = []
        for host in ("127.0.0.2", "127.0.0.3"):
            port = free_port(host)
            procs.append(
                spawn(
                    [
                        sys.executable,
                        "-m",
                        "smg_sim",
                        "--host",
                        host,
                        "--port",
                        str(port),
                        "--model",
                        MODEL,
                        "--time-scale",
                        "0.0001",
                        "--log-level",
                        "warning",
                    ],
                    core=1,
                )
            )
            sims.append(f"http://{host}:{port}")
        for s in sims:
            wait_http(s + "/health")
        results = measure("direct", sims[0], None, args)

        port = free_port("127.0.0.1")
        router = spawn(
            [sys.executable, "-m", "smg_router", "--port", str(port), "--worker-urls", *sims, "--log-level", "warning"],
            core=1,
        )
        procs.append(router)
        wait_http(f"http://127.0.0.1:{port}/readiness")
        results += measure("smg-router (python)", f"http://127.0.0.1:{port}", router.pid, args)

        rust = args.rust_bin
        if args.rust and rust:
            rport = free_port("127.0.0.1")
            rproc = spawn(
                [
                    rust,
                    "launch",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(rport),
                    "--worker-urls",
                    *sims,
                    "--policy",
                    "cache_aware",
                ],
                core=1,
            )
            procs.append(rproc)
            wait_http(f"http://127.0.0.1:{rport}/health", timeout=60)
            results += measure("smg (rust)", f"http://127.0.0.1:{rport}", rproc.pid, args)
        elif args.rust:
            print("note: --rust given but no `smg` command found (pip install smg)")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
    direct = {r.concurrency: r for r in results if r.name == "direct"}
    rust_by_c = {r.concurrency: r for r in results if r.name == "smg (rust)"}
    print(
        f"{'target':22} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'cpu µs/req':>10} "
        f"{'p50 vs direct':>14} {'cpu vs rust':>12}"
    )
    for r in results:
        vs_direct = f"+{r.p50_ms - direct[r.concurrency].p50_ms:.3f} ms"
        rust_r = rust_by_c.get(r.concurrency)
        vs_rust = f"{r.cpu_us / rust_r.cpu_us:.2f}x" if r.cpu_us and rust_r and rust_r.cpu_us else "-"
        cpu = f"{r.cpu_us:.0f}" if r.cpu_us else "-"
        print(
            f"{r.name:22} {r.concurrency:>4} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f} {r.rps:>8.0f} {cpu:>10} "
            f"{vs_direct:>14} {vs_rust:>12}"
        )


if __name__ == "__main__":
    main()
