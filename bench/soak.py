"""Soak: a router in front of four simulated workers at ~80% of their capacity, one worker killed and restarted
every interval, mixed streaming and non-streaming requests.  Prints (or emits as JSON) what was lost.

Usage:  python bench/soak.py [--duration 600] [--kill-every 60] [--load 0.8] [--hostile] [--json]

Capacity is measured first, through the router, on this machine: workers x --max-running closed-loop clients
for --calibrate seconds (each `smg-sim` runs at most --max-running requests at once); arrivals are then
Poisson at --load of the measured requests per second (a figure computed from the engine model alone
overstates what a busy 2-core machine serves, and an overloaded fleet's queue grows without bound).

Reported: non-streaming requests that did not answer 200 (must be 0: a killed worker's requests are retried
before their first byte), streams that ended without `[DONE]` (must be 0; a stream cut by the kill ends with
an error event, then `[DONE]`), the router's RSS after --warmup seconds and at the end (growth must stay under
10%), and the longest event-loop lag (the upper edge of the highest non-empty bucket of
`smg_event_loop_lag_seconds`) and its p99 over the arrivals (the upper edge of the bucket that holds it).

With --hostile, hostile traffic is mixed into the same run (``bench/soak_hostile.py``): --slow-clients connections
that trickle their body or head (each must get a 408 and be closed; a new one is opened), --pipelining-clients
connections that pipeline ~1 MiB requests behind a slow one, and a silent peer (``--peer`` at a listener that
never answers, with ``--peer-secret``).  What they got is reported next to what the legitimate requests got.

The router and the workers run this checkout's code: their PYTHONPATH starts with its ``router`` and ``sim``.
Run from the repository root with the project's venv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from soak_hostile import HostileTally, SilentPeer, pipelining_client, slow_client  # noqa: E402
from support.procs import free_port, sim_args  # noqa: E402

MODEL = "soak-model"
PROMPT = "soak " * 40


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if get(url, 1.0)[0] == 200:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child_env() -> dict[str, str]:
    """The environment of the router and the workers: this checkout's packages first, whatever is installed after."""
    paths = [str(ROOT / "router"), str(ROOT / "sim"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def lag_buckets(metrics: str) -> list[tuple[float, float]]:
    """The cumulative buckets of smg_event_loop_lag_seconds, by upper edge."""
    counts: list[tuple[float, float]] = []
    for m in re.finditer(r'^smg_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', metrics, re.M):
        counts.append((float(m.group(1)), float(m.group(2))))
    return sorted(counts)


def max_loop_lag(metrics: str) -> float:
    """Upper edge of the highest bucket of smg_event_loop_lag_seconds that holds a sample."""
    previous, edge = 0.0, 0.0
    for le, cumulative in lag_buckets(metrics):
        if cumulative > previous:
            edge = le
        previous = cumulative
    return edge


def loop_lag_quantile(before: str, after: str, q: float) -> float:
    """Upper edge of the bucket of smg_event_loop_lag_seconds that holds the ``q`` quantile of the samples taken
    between two expositions (0.0 without any)."""
    earlier = dict(lag_buckets(before))
    counts = [(le, cumulative - earlier.get(le, 0.0)) for le, cumulative in lag_buckets(after)]
    if not counts or counts[-1][1] <= 0:
        return 0.0
    total = counts[-1][1]
    return next(le for le, cumulative in counts if cumulative >= q * total)


def peer_records(metrics: str) -> dict[str, float]:
    """smg_peer_records_sent_total by outcome, summed over peers."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^smg_peer_records_sent_total\{([^}]*)\} (\S+)$", metrics, re.M):
        outcome = re.search(r'outcome="([^"]+)"', m.group(1))
        if outcome:
            out[outcome.group(1)] = out.get(outcome.group(1), 0.0) + float(m.group(2))
    return out


def router_source() -> str:
    """Where the router the soak starts imports smg_router from (this checkout's ``router/``, or it is not)."""
    out = subprocess.run(
        [sys.executable, "-c", "import smg_router; print(smg_router.__file__)"],
        capture_output=True,
        text=True,
        env=child_env(),
        check=False,
    )
    return out.stdout.strip()


def git_commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


@dataclass
class Sim:
    host: str
    port: int
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
        wait_http(self.url + "/health")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None


@dataclass
class Tally:
    sent: int = 0
    json_ok: int = 0
    json_lost: list[str] = field(default_factory=list)
    streams_done: int = 0
    streams_cut_with_error_event: int = 0
    streams_lost: list[str] = field(default_factory=list)
    kills: int = 0
    rss_first: int = 0
    rss_last: int = 0
    rss_samples: list[int] = field(default_factory=list)
    max_loop_lag_s: float = 0.0
    loop_lag_p99_s: float = 0.0
    capacity_rps: float = 0.0
    rate_rps: float = 0.0
    duration_s: float = 0.0
    peer_records: dict[str, float] = field(default_factory=dict)


async def one_request(s: aiohttp.ClientSession, url: str, tally: Tally, *, stream: bool, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": f"{uuid.uuid4()} {PROMPT}", "max_tokens": max_tokens, "stream": stream}
    tally.sent += 1
    try:
        async with s.post(url + "/v1/completions", json=body) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as e:
        (tally.streams_lost if stream else tally.json_lost).append(f"{type(e).__name__}: {e}")
        return
    if not stream:
        if status == 200:
            tally.json_ok += 1
        else:
            tally.json_lost.append(f"{status}: {raw[:200]!r}")
        return
    events = [line[6:] for line in raw.decode(errors="replace").splitlines() if line.startswith("data: ")]
    if status != 200 or not events or events[-1] != "[DONE]":
        tally.streams_lost.append(f"{status}: ...{raw[-200:]!r}")
    elif len(events) >= 2 and events[-2].startswith('{"error"'):
        tally.streams_cut_with_error_event += 1
    else:
        tally.streams_done += 1


async def measure_capacity(router_url: str, clients: int, args: argparse.Namespace) -> float:
    """Completed requests per second with ``clients`` closed-loop clients (half of them streaming)."""
    tally = Tally()
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        end = loop.time() + args.calibrate

        async def client(i: int) -> int:
            done = 0
            while loop.time() < end:
                await one_request(s, router_url, tally, stream=i % 2 == 0, max_tokens=args.max_tokens)
                done += 1
            return done

        t0 = loop.time()
        done = sum(await asyncio.gather(*(client(i) for i in range(clients))))
        return done / (loop.time() - t0)


def start_hostile(router_url: str, hostile: HostileTally, args: argparse.Namespace) -> list[asyncio.Task[None]]:
    """The slow and the pipelining clients, each a task that reconnects until it is cancelled."""
    loop = asyncio.get_running_loop()
    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    tasks = [
        loop.create_task(
            slow_client(host, int(port), hostile, index=i, interval=args.slow_interval), name=f"soak-slow-client-{i}"
        )
        for i in range(args.slow_clients)
    ]
    tasks += [
        loop.create_task(
            pipelining_client(
                host,
                int(port),
                hostile,
                index=i,
                model=MODEL,
                slow_tokens=args.pipeline_slow_tokens,
                bodies=args.pipeline_bodies,
                pause=args.pipeline_pause,
            ),
            name=f"soak-pipelining-client-{i}",
        )
        for i in range(args.pipelining_clients)
    ]
    return tasks


async def drive(
    router_url: str,
    router_pid: int,
    sims: list[Sim],
    args: argparse.Namespace,
    *,
    hostile: HostileTally | None = None,
    peer: SilentPeer | None = None,
) -> Tally:
    tally = Tally()
    if peer is not None:
        await peer.start()
    tally.capacity_rps = capacity = await measure_capacity(router_url, len(sims) * args.max_running, args)
    tally.rate_rps = rate = capacity * args.load
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    metrics_before = (await asyncio.to_thread(get, router_url + "/metrics"))[1].decode()
    hostile_tasks = start_hostile(router_url, hostile, args) if hostile is not None else []
    start = loop.time()
    next_kill = start + args.kill_every
    next_sample = start
    tasks: set[asyncio.Task[None]] = set()
    restarting: asyncio.Task[None] | None = None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
        while (now := loop.time()) - start < args.duration:
            if now >= next_sample:
                tally.rss_samples.append(rss_bytes(router_pid))
                if not tally.rss_first and now - start >= args.warmup:
                    tally.rss_first = tally.rss_samples[-1]
                next_sample += 1.0
            if now >= next_kill and restarting is None:
                victim = sims[tally.kills % len(sims)]
                victim.kill()
                tally.kills += 1
                # back on the same address and port, as a pod restarted in place; arrivals go on meanwhile
                restarting = loop.create_task(asyncio.to_thread(victim.start))
                next_kill += args.kill_every
            if restarting is not None and restarting.done():
                restarting.result()
                restarting = None
            task = loop.create_task(
                one_request(s, router_url, tally, stream=rng.random() < 0.5, max_tokens=args.max_tokens)
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        tally.rss_samples.append(rss_bytes(router_pid))  # at the end of the arrivals, before the drain
        for hostile_task in hostile_tasks:
            hostile_task.cancel()
        await asyncio.gather(*hostile_tasks, return_exceptions=True)
        if tasks:
            await asyncio.wait(tasks, timeout=120)
        if restarting is not None:
            await restarting
    tally.duration_s = loop.time() - start
    tally.rss_last = tally.rss_samples[-1]
    metrics_after = (await asyncio.to_thread(get, router_url + "/metrics"))[1].decode()
    tally.max_loop_lag_s = max_loop_lag(metrics_after)
    tally.loop_lag_p99_s = loop_lag_quantile(metrics_before, metrics_after, 0.99)
    if peer is not None:
        tally.peer_records = peer_records(metrics_after)
        await peer.stop()
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--load", type=float, default=0.8, help="fraction of the fleet's capacity")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--calibrate", type=float, default=10.0, help="seconds of measuring the fleet's capacity")
    p.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds after which the first RSS figure is taken (pools, caches and the tree are full)",
    )
    p.add_argument(
        "--rss-window",
        type=float,
        default=10.0,
        help="seconds of RSS samples whose median is compared too (after --warmup and at the end): with --hostile "
        "a single sample is up to ~20%% off, by the 1 MiB bodies being parsed at that second",
    )
    p.add_argument(
        "--tree-memory-budget", type=int, default=4 * 2**20, help="the router's --tree-memory-budget (bytes)"
    )
    h = p.add_argument_group("hostile traffic (--hostile)")
    h.add_argument("--hostile", action="store_true", help="mix slow and pipelining clients and a silent peer in")
    h.add_argument("--slow-clients", type=int, default=8, help="connections trickling a body or a head at once")
    h.add_argument("--slow-interval", type=float, default=1.0, help="seconds between two 16-byte pieces")
    h.add_argument("--pipelining-clients", type=int, default=4, help="connections pipelining requests at once")
    h.add_argument("--pipeline-bodies", type=int, default=4, help="~1 MiB requests pipelined behind the slow one")
    h.add_argument("--pipeline-slow-tokens", type=int, default=64, help="the slow first request's max_tokens")
    h.add_argument("--pipeline-pause", type=float, default=2.0, help="seconds between two pipelining connections")
    h.add_argument(
        "--head-timeout",
        type=float,
        default=5.0,
        help="the router's --head-timeout with --hostile (its default, 20 s, gives a short run few 408s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    hostile = HostileTally() if args.hostile else None
    peer = SilentPeer("127.0.0.1", hostile) if hostile is not None else None
    hostile_flags = (
        [
            "--head-timeout",
            str(args.head_timeout),
            "--peer",
            peer.url,
            "--peer-secret",
            secrets.token_hex(16),
        ]
        if peer is not None
        else []
    )
    sims = []
    for i in range(args.workers):
        host = f"127.0.1.{10 + i}"
        port = free_port(host)
        sims.append(
            Sim(
                host,
                port,
                sim_args(
                    host,
                    port,
                    model=MODEL,
                    time_scale=1,
                    extra=["--max-running", str(args.max_running), "--log-level", "warning"],
                ),
            )
        )
    router: subprocess.Popen[bytes] | None = None
    try:
        for sim in sims:
            sim.start()
        port = free_port("127.0.0.1")
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "smg_router",
                "--port",
                str(port),
                "--log-level",
                "error",
                "--health-check-interval",
                "0.5",
                "--shutdown-delay",
                "0",
                # every prompt is unique: a small tree budget is reached within the first
                # minute, so RSS growth after it measures leaks, not the tree filling up
                "--tree-memory-budget",
                str(args.tree_memory_budget),
                *hostile_flags,
                "--worker-urls",
                *(s.url for s in sims),
            ],
            env=child_env(),
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = get(url + "/workers")
            if status == 200 and sum(w["routable"] for w in json.loads(body)["workers"]) == len(sims):
                break
            time.sleep(0.1)
        tally = asyncio.run(drive(url, router.pid, sims, args, hostile=hostile, peer=peer))
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                router.wait(timeout=40)
        for sim in sims:
            sim.kill()
    growth = tally.rss_last / tally.rss_first - 1 if tally.rss_first else 0.0
    # one sample a second from the start of the arrivals; the first window begins at --warmup
    first_window = tally.rss_samples[int(args.warmup) : int(args.warmup) + int(args.rss_window)]
    last_window = tally.rss_samples[-int(args.rss_window) :]
    window_first = statistics.median(first_window) if first_window else 0.0
    window_last = statistics.median(last_window) if last_window else 0.0
    result = {
        "command": " ".join(["bench/soak.py", *(sys.argv[1:] if argv is None else argv)]),
        "started": started,
        "commit": git_commit(),
        "router_source": router_source(),
        **asdict(tally),
        "legit_lost": len(tally.json_lost) + len(tally.streams_lost),
        "rss_growth": growth,
        "rss_window_s": args.rss_window,
        "rss_first_window_median": window_first,
        "rss_last_window_median": window_last,
        "rss_growth_window": window_last / window_first - 1 if window_first else 0.0,
        "json_lost": tally.json_lost[:10],
        "streams_lost": tally.streams_lost[:10],
        "json_lost_count": len(tally.json_lost),
        "streams_lost_count": len(tally.streams_lost),
    }
    result["rss_mb_per_second"] = [round(b / 2**20, 1) for b in result.pop("rss_samples")]
    if hostile is not None:
        result["hostile"] = hostile.as_dict()
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32} {v}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
