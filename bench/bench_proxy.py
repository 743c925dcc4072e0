"""Proxy benchmark: what a router costs per request, beside a direct connection, the Rust `smg` and vLLM's router.

Usage (from the repository root, with the project's venv):
    .venv/bin/python bench/bench_proxy.py [--reps 3] [--duration 5] [--warmup 1]
        [--targets direct,smg:round_robin,smg:cache_aware,rust:round_robin,rust:cache_aware,
                   vllm:round_robin,vllm:cache_aware]
        [--endpoints generate,chat] [--streams 0,1] [--concurrency 1,64]
        [--rust-bin /tmp/smg-rust/bin/smg] [--vllm-bin /tmp/vllm-router/bin/vllm-router]
        [--router-commit REV] [--out results.json] [--quick]
    (a target smg@REV:<policy> runs smg-router as of git REV: before and after side by side in one run;
    smg:<policy>+peer runs a second smg-router as the first's --peer, and counts both routers' CPU: what a request
    costs a fleet of replicas that tell each other their routes, the sending and the receiving; smg:<policy>~NAME
    runs it with the flags of ``--variant NAME="FLAGS"``, e.g. ``--variant nocap="--tree-chars-per-token 0"``;
    smg%PY:<policy> runs it on the interpreter of ``--python PY=PATH``, e.g. an optimized build of CPython beside
    this machine's, the router's code still the working tree's or REV's; smg:<policy>*N runs it with ``--processes N``,
    every other smg target with one process, and ``--router-cores 0,1`` lets the routers and workers use both cores
    of a 2-core machine, wrk's core too)

The method (docs/benchmarks.md): two smg-sim workers with no simulated
GPU time (``--time-scale 0.0001``, 2-4 tokens: the proxy dominates) and every router under test run on core 1,
the load generator ``wrk`` (one thread, ``bench/wrk/post.lua``: ~1 KB POST bodies, every prompt distinct with a
shared document prefix) on core 0.  All targets run side by side for the whole run and every repetition visits
every cell and target in turn (the target order rotates), so a slow minute on the shared machine hits every
target alike.  Per cell and target: throughput, wrk's latency p50/p99, and the router's CPU time per request
(utime + stime of the process and its descendants, every thread, from ``/proc/PID/stat``); the median over
repetitions and the spread (min-max).  Routers run with their defaults (metrics, retries, timeouts, admission
limits, load monitor, health checks all on).  ``smg`` is the working tree's router, or ``--router-commit``'s
(``git archive`` of ``router/`` first on PYTHONPATH, as in bench/routing).  Rust cells are skipped, with a
note, when the Rust binary is absent (``python3 -m venv /tmp/smg-rust && /tmp/smg-rust/bin/pip install
'smg==1.13.*'``); so are ``vllm:<policy>`` cells, vLLM's router (a Rust router in a Python wheel, one process),
when its launcher is absent (``python3 -m venv /tmp/vllm-router && /tmp/vllm-router/bin/pip install
'vllm-router==0.1.17'``); its cache_aware posts each chat request to a worker's ``/v1/chat/completions/render``
before routing it (smg-sim answers it as vLLM does: the prompt's token ids), a round trip its chat cells
include, as they would in front of vLLM.  Compare ratios
from one run, not absolutes (they vary three-fold between machines).
Exits 1 when any request failed (wrk socket errors or a non-2xx answer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE / "routing"), str(ROOT / "tests")]

from fleet import router_code, stop_all, wait_for  # noqa: E402
from support.procs import Proc, Router, Sim, free_port, free_ports, http_json, next_host, sim_args  # noqa: E402

LUA = HERE / "wrk" / "post.lua"
MODEL = "bench-model"
HZ = os.sysconf("SC_CLK_TCK")
LOAD_CORE, SUT_CORE = 0, 1
MAX_TOKENS = {"generate": 4, "chat": 2}
"""Tokens per answer: streamed, both make 4 SSE chunks before ``[DONE]`` (chat adds its role and finish chunks)."""
DEFAULT_TARGETS = (
    "direct,smg:round_robin,smg:cache_aware,rust:round_robin,rust:cache_aware,vllm:round_robin,vllm:cache_aware"
)
BASELINES = {"rust": "Rust", "vllm": "vLLM"}
"""The other routers measured beside smg-router (target ``KIND:<policy>``), each in a table column of ratios."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One load shape: endpoint, streamed or not, wrk connections."""

    endpoint: str
    stream: bool
    concurrency: int

    @property
    def label(self) -> str:
        return f"{'/generate' if self.endpoint == 'generate' else 'chat'}{' stream' if self.stream else ''}"


@dataclass(slots=True)
class Run:
    """One wrk run of one target on one cell."""

    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]
    cpu_us: float | None
    worker_cpu_us: float


@dataclass(slots=True)
class Measured:
    target: str
    cell: Cell
    runs: list[Run] = field(default_factory=list)
    check: dict[str, Any] = field(default_factory=dict)

    def stat(self, name: str) -> tuple[float, float, float] | None:
        """Median, min, max of one figure over the repetitions (None when not measured)."""
        values = [getattr(r, name) for r in self.runs if getattr(r, name) is not None]
        if not values:
            return None
        return statistics.median(values), min(values), max(values)

    def failures(self) -> int:
        return sum(sum(r.errors.values()) for r in self.runs)


# --- processes -------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """``pid`` and every live descendant (the Rust `smg` is a Python launcher; its children count too; vLLM's
    router runs its Rust code inside its launcher's process)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """utime + stime of the processes (each one's figure covers all its threads)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / HZ


def tree_cpu(procs: Sequence[Proc]) -> float:
    return cpu_seconds(p for proc in procs if proc.popen for p in descendants(proc.popen.pid))


def start_sims(logs: Path, count: int) -> list[Sim]:
    sims: list[Sim] = []
    for _ in range(count):
        host = next_host()
        port = free_port(host)
        args = sim_args(
            host, port, model=MODEL, time_scale=0.0001, extra=("--max-running", "128", "--log-level", "warning")
        )
        name = f"sim-{host}-{port}"
        sims.append(Sim(name=name, args=args, log_path=logs / f"{name}.log", host=host, port=port))
        sims[-1].start()
    for sim in sims:
        wait_for(lambda s=sim: http_json("GET", s.url + "/health", timeout=1)[0] == 200, timeout=30, what=sim.url)
    return sims


def router_argv(
    target: str,
    port: int,
    workers: Sequence[str],
    rust_bin: str,
    peer: int | None = None,
    extra: Sequence[str] = (),
    python: str = sys.executable,
    vllm_bin: str = "",
) -> list[str]:
    """The target's command line: its defaults, plus only where to listen, which workers to use (and its peer, and
    the flags of its ``--variant``)."""
    kind, _, policy = target.partition(":")
    policy, _, processes = policy.partition("~")[0].removesuffix("+peer").partition("*")
    if kind.startswith("smg"):
        return [
            *(python, "-m", "smg_router", "--host", "127.0.0.1", "--port", str(port)),
            *("--policy", policy, "--log-level", "warning", "--worker-urls", *workers),
            *(("--processes", processes) if processes else ()),
            *(("--peer", f"http://127.0.0.1:{peer}") if peer else ()),
            *extra,
        ]
    if kind == "vllm":
        return [
            *(vllm_bin, "--host", "127.0.0.1", "--port", str(port), "--policy", policy),
            # its metrics server: loopback (its default too) and a port of its own (29000 by default)
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1"))),
            *("--log-level", "warning", "--worker-urls", *workers),
        ]
    return [
        *(rust_bin, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy),
        # its metrics server binds 0.0.0.0:29000 by default: keep it on loopback and off other runs' ports
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1"))),
        *("--log-level", "warn", "--worker-urls", *workers),
    ]


def ready(target: str, router: Router, workers: int) -> bool:
    """Every worker is routable (or the router exited: no use waiting)."""
    if not router.alive():
        return True
    if target.startswith("smg"):
        status, body = http_json("GET", router.url + "/workers", timeout=1)
        return status == 200 and sum(bool(w["routable"]) for w in body["workers"]) == workers
    # the Rust smg and vLLM's router answer /readiness alike (vLLM's only asks the workers' /health at start)
    status, body = http_json("GET", router.url + "/readiness", timeout=1)
    return status == 200 and bool(body.get("healthy_workers") == workers)


def start_router(
    logs: Path,
    target: str,
    workers: Sequence[str],
    *,
    rust_bin: str,
    pythonpath: Path | None,
    vllm_bin: str = "",
    port: int | None = None,
    peer: int | None = None,
    extra: Sequence[str] = (),
    python: str = sys.executable,
) -> Router:
    port = port or free_port("127.0.0.1")
    env = {"SMG_PROCESSES": "1"} if target.startswith("smg") else {}  # one process unless the target says *N
    if target.startswith("smg") and pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
    name = f"{re.sub(r'[:+%*]', '-', target)}-{port}"
    args = router_argv(target, port, workers, rust_bin, peer, extra, python, vllm_bin)
    router = Router(name=name, args=args, log_path=logs / f"{name}.log", env=env, port=port)
    router.start()
    wait_for(partial(ready, target, router, len(workers)), timeout=60, what=f"{target} at {router.url}")
    if not router.alive():
        raise RuntimeError(f"{target} exited:\n{router.log()[-2000:]}")
    return router


# --- load ------------------------------------------------------------------------------------------


def wrk(url: str, cell: Cell, seconds: int, nonce: str) -> dict[str, Any]:
    """One wrk run on the load core; its ``done()`` summary (latencies in µs)."""
    argv = [
        *(["taskset", "-c", str(LOAD_CORE)] if shutil.which("taskset") else []),
        *("wrk", "-t1", f"-c{cell.concurrency}", f"-d{seconds}s", "--timeout", "10s", "-s", str(LUA), url, "--"),
        *(cell.endpoint, "1" if cell.stream else "0", str(MAX_TOKENS[cell.endpoint]), nonce, MODEL),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"no summary from wrk:\n{out}")
    summary: dict[str, Any] = json.loads(line.removeprefix("WRK_JSON "))
    return summary


def check(url: str, cell: Cell) -> dict[str, Any]:
    """One request of the cell's shape, read whole: the answer is a real one (and a stream ends in [DONE])."""
    question = f"check {uuid.uuid4().hex}: what does the document say?"
    body: dict[str, Any]
    if cell.endpoint == "generate":
        body = {"text": "You are a benchmark. " + question, "stream": cell.stream}
        body["sampling_params"] = {"max_new_tokens": MAX_TOKENS["generate"], "temperature": 0}
        path = "/generate"
    else:
        messages = [{"role": "system", "content": "You are a benchmark."}, {"role": "user", "content": question}]
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS["chat"], "stream": cell.stream}
        path = "/v1/chat/completions"
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        status, raw = resp.status, resp.read().decode()
    if not cell.stream:
        answer = json.loads(raw)
        ok = status == 200 and ("text" in answer or bool(answer.get("choices")))
        return {"status": status, "ok": ok}
    events = [ln[5:].strip() for ln in raw.splitlines() if ln.startswith("data:")]
    ok = status == 200 and bool(events) and events[-1] == "[DONE]"
    return {"status": status, "ok": ok, "chunks": len(events) - 1}


def measure(url: str, cell: Cell, *, seconds: int, warmup: int, routers: Sequence[Proc], sims: Sequence[Proc]) -> Run:
    """One wrk run at ``url``; CPU per request of ``routers`` (the one under test, and its peer if it has one) as
    ``cpu_us`` and of ``sims`` (the workers, or whatever else the caller watches) as ``worker_cpu_us``."""
    if warmup:
        wrk(url, cell, warmup, "warm" + uuid.uuid4().hex[:8])
    cpu0, wcpu0 = tree_cpu(routers), tree_cpu(sims)
    s = wrk(url, cell, seconds, uuid.uuid4().hex[:8])
    cpu1, wcpu1 = tree_cpu(routers), tree_cpu(sims)
    n = max(1, s["requests"])
    lat = s["latency_us"]
    return Run(
        requests=s["requests"],
        seconds=s["duration_us"] / 1e6,
        rps=s["requests"] / (s["duration_us"] / 1e6),
        p50_ms=lat["p50"] / 1e3,
        p99_ms=lat["p99"] / 1e3,
        errors=s["errors"],
        cpu_us=(cpu1 - cpu0) / n * 1e6 if routers else None,
        worker_cpu_us=(wcpu1 - wcpu0) / n * 1e6,
    )


# --- report ----------------------------------------------------------------------------------------


def fmt(stat: tuple[float, float, float] | None, digits: int = 0) -> str:
    if stat is None:
        return "-"
    med, lo, hi = stat
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def ratio(a: Measured | None, b: Measured | None, name: str = "cpu_us") -> float | None:
    sa, sb = (a.stat(name) if a else None), (b.stat(name) if b else None)
    return sa[0] / sb[0] if sa and sb and sb[0] else None


def added_p50_us(m: Measured, results: dict[tuple[str, Cell], Measured]) -> float | None:
    """p50 over the direct connection's in the same cell, in µs: the median over repetitions of each one's
    difference (a repetition measures both within seconds, so a slow minute on the machine mostly cancels)."""
    direct = results.get(("direct", m.cell))
    if direct is None or not m.runs or len(direct.runs) != len(m.runs):
        return None
    return statistics.median((r.p50_ms - d.p50_ms) * 1e3 for r, d in zip(m.runs, direct.runs, strict=True))


RATIO_POLICIES = ("cache_aware", "round_robin")


def table(results: dict[tuple[str, Cell], Measured], cells: Sequence[Cell], targets: Sequence[str]) -> str:
    """One row per cell and target; CPU per request as a ratio to each baseline's policy of the same name."""
    vs = [f"vs {name} {policy}" for name in BASELINES.values() for policy in RATIO_POLICIES]
    names = ["c", "load", "target", "CPU µs/req", *vs, "p50 ms", "p99 ms", "req/s", "p50 added vs direct µs"]
    rows = [f"| {' | '.join(names)} |", f"|{' --- |' * len(names)}"]
    for cell in sorted(cells, key=lambda c: (c.concurrency, c.endpoint != "generate", c.stream)):
        for target in targets:
            m = results.get((target, cell))
            if m is None:
                continue
            ratios = [
                ratio(m, results.get((f"{kind}:{policy}", cell))) if m.target.endswith(policy) else None
                for kind in BASELINES
                for policy in RATIO_POLICIES
            ]
            added = added_p50_us(m, results) if target != "direct" else None
            rows.append(
                f"| {cell.concurrency} | {cell.label} | {target} | {fmt(m.stat('cpu_us'))} "
                + "".join(f"| {f'{r:.2f}' if r else ''} " for r in ratios)
                + f"| {fmt(m.stat('p50_ms'), 2)} | {fmt(m.stat('p99_ms'), 1)} | {fmt(m.stat('rps'))} "
                f"| {f'{added:.0f}' if added is not None else ''} |"
            )
    return "\n".join(rows)


def c1_latency(results: dict[tuple[str, Cell], Measured], cells: Sequence[Cell], targets: Sequence[str]) -> str:
    """The c=1 added p50 over direct, each target against the Rust one (and vLLM's) of its policy."""
    lines = []
    for cell in (c for c in cells if c.concurrency == 1):
        parts = []
        for target in (t for t in targets if t.startswith("smg")):
            m = results.get((target, cell))
            added = added_p50_us(m, results) if m else None
            if added is None:
                continue
            vs = ""
            for kind, name in BASELINES.items():
                base = results.get((f"{kind}:{target.partition(':')[2]}", cell))
                base_added = added_p50_us(base, results) if base else None
                vs += f" vs {name} {base_added:.0f} µs ({added / base_added:.2f}x)" if base_added else ""
            parts.append(f"{target} +{added:.0f} µs{vs}")
        if parts:
            lines.append(f"- c=1 {cell.label}: " + "; ".join(parts))
    return "\n".join(lines)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--targets",
        default=DEFAULT_TARGETS,
        help="comma-separated: direct, smg:<policy>, smg@REV:<policy> (smg-router as of git REV), smg%%PY:<policy> "
        "(on --python PY's interpreter), smg:<policy>*N (--processes N), rust:<policy>, vllm:<policy> (vLLM's router)",
    )
    p.add_argument(
        "--router-cores",
        default=str(SUT_CORE),
        help=f"comma-separated cores the routers and workers run on (default: {SUT_CORE}; wrk runs on {LOAD_CORE})",
    )
    p.add_argument("--endpoints", default="generate,chat")
    p.add_argument("--streams", default="0,1", help="0: whole answers, 1: SSE streams")
    p.add_argument("--concurrency", default="1,64", help="wrk connections per cell")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--duration", type=int, default=5, help="seconds measured per run")
    p.add_argument("--warmup", type=int, default=1, help="seconds of unmeasured load before each run")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help='extra smg-router flags for the targets smg:<policy>~NAME, e.g. nocap="--tree-chars-per-token 0"',
    )
    p.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="PY=PATH",
        help="a Python for the targets smg%%PY:<policy> (its environment needs the router's dependencies: "
        "PATH -m venv DIR && DIR/bin/pip install .; the code is the working tree's, or REV's)",
    )
    p.add_argument("--rust-bin", default="/tmp/smg-rust/bin/smg")
    p.add_argument(
        "--vllm-bin",
        default="/tmp/vllm-router/bin/vllm-router",
        help="vLLM's router launcher, for the targets vllm:<policy> (pip install 'vllm-router==0.1.17', own venv)",
    )
    p.add_argument("--router-commit", help="measure smg-router as of this git revision (default: the working tree)")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "out" / "proxy.json",
        help="every figure, the settings and the command as JSON (git ignores bench/out)",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 1 rep of 1 s, chat at c=8, streamed and not")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.duration, args.warmup, args.endpoints, args.concurrency = 1, 1, 0, "chat", "8"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t != "direct" and not re.fullmatch(
            r"smg(@[\w./~^-]+)?(%\w+)?:[a-z_]+(\*[0-9]+)?(\+peer)?(~\w+)?|(rust|vllm):\w+", t
        ):
            sys.exit(
                f"bench_proxy: target {t!r}: expected direct, smg[@REV][%PY]:<policy>[*N][+peer][~NAME], rust:<policy> "
                "or vllm:<policy>"
            )
    if not shutil.which("wrk"):
        sys.exit("bench_proxy: needs `wrk` (Debian package wrk; scripts/install-test-tools.sh installs it)")
    variants = {name: shlex.split(flags) for name, _, flags in (v.partition("=") for v in args.variant)}
    pythons = {name: path for name, _, path in (v.partition("=") for v in args.python)}
    for t in targets:
        if "~" in t.partition(":")[2] and t.rpartition("~")[2] not in variants:
            sys.exit(f"bench_proxy: target {t!r}: no --variant {t.rpartition('~')[2]}=FLAGS")
        py = t.partition(":")[0].partition("%")[2]
        if py and not os.access(pythons.get(py, ""), os.X_OK):
            sys.exit(f"bench_proxy: target {t!r}: no --python {py}=PATH to an executable")
    skipped = []
    for kind, binary in (("rust", args.rust_bin), ("vllm", args.vllm_bin)):
        missing = [t for t in targets if t.startswith(kind + ":") and not os.access(binary, os.X_OK)]
        if missing:
            print(f"note: {binary} not found: skipping {', '.join(missing)}", file=sys.stderr)
            skipped += missing
    targets = [t for t in targets if t not in skipped]
    cells = [
        Cell(e, s == "1", int(c))
        for c in args.concurrency.split(",")
        for e in args.endpoints.split(",")
        for s in args.streams.split(",")
    ]
    cores = {int(c) for c in args.router_cores.split(",") if c}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    head, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "router"))
    logs = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    pythonpath = router_code(args.router_commit, logs) if args.router_commit else None
    results: dict[tuple[str, Cell], Measured] = {}
    procs: list[Proc] = []
    try:
        os.sched_setaffinity(0, cores)  # what this process starts inherits the cores under test
        sims = start_sims(logs, 2)
        procs += sims
        routers: dict[str, list[Router]] = {"direct": []} if "direct" in targets else {}
        for t in targets:
            if t != "direct":
                kind, py = t.partition(":")[0].partition("%")[::2]
                rev = kind.partition("@")[2]
                code = router_code(rev, logs) if rev else pythonpath or ROOT / "router"  # whatever the interpreter
                urls_ = [s.url for s in sims]
                flags = variants.get(t.rpartition("~")[2], []) if "~" in t.partition(":")[2] else []
                python = pythons[py] if py else sys.executable
                start = partial(
                    start_router,
                    logs,
                    t,
                    urls_,
                    rust_bin=args.rust_bin,
                    vllm_bin=args.vllm_bin,
                    pythonpath=code,
                    extra=flags,
                    python=python,
                )
                if t.endswith("+peer"):  # each the other's --peer; the second one only receives
                    ports = free_ports(2)
                    routers[t] = [start(port=ports[0], peer=ports[1]), start(port=ports[1], peer=ports[0])]
                else:
                    routers[t] = [start()]
                procs += routers[t]
        os.sched_setaffinity(0, {LOAD_CORE})
        urls = {t: (r[0].url if r else sims[0].url) for t, r in routers.items()}
        for t in targets:
            for cell in cells:
                m = results[(t, cell)] = Measured(t, cell)
                m.check = check(urls[t], cell)
                if not m.check["ok"]:
                    raise RuntimeError(f"{t} {cell}: bad answer {m.check}")
        for rep in range(args.reps):
            for cell in cells:
                order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                for t in order:
                    run = measure(
                        urls[t], cell, seconds=args.duration, warmup=args.warmup, routers=routers[t], sims=sims
                    )
                    results[(t, cell)].runs.append(run)
                    print(
                        f"rep {rep + 1}/{args.reps} c={cell.concurrency} {cell.label:14} {t:18} "
                        f"{run.rps:7.0f} req/s  p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:6.1f} ms  "
                        f"cpu {run.cpu_us or 0:5.0f} µs/req  errors {sum(run.errors.values())}",
                        file=sys.stderr,
                        flush=True,
                    )
    except BaseException:
        print(f"bench_proxy: logs kept in {logs}", file=sys.stderr)
        raise
    finally:
        stop_all([p for p in procs if isinstance(p, Router)], kill=True)
        stop_all([p for p in procs if not isinstance(p, Router)])
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    failures = sum(m.failures() for m in results.values())
    if args.out:
        doc = {
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "started": started,
            "commit": head,
            "dirty_router": None if args.router_commit else dirty,
            "router_commit": git("rev-parse", args.router_commit) if args.router_commit else None,
            "target_commits": {
                t: git("rev-parse", t.partition(":")[0].partition("%")[0][4:]) for t in targets if t.startswith("smg@")
            },
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "settings": {
                "reps": args.reps,
                "duration_s": args.duration,
                "warmup_s": args.warmup,
                "variants": variants,
                "pythons": pythons,
                "max_tokens": MAX_TOKENS,
                "rust_bin": args.rust_bin,
                "vllm_bin": args.vllm_bin,
                "cores": {"wrk": LOAD_CORE, "routers_and_workers": sorted(cores)},
            },
            "skipped": skipped,
            "cells": [
                {
                    "target": m.target,
                    **asdict(m.cell),
                    "check": m.check,
                    "median": {k: (s[0] if (s := m.stat(k)) else None) for k in ("cpu_us", "p50_ms", "p99_ms", "rps")},
                    "added_p50_us": added_p50_us(m, results) if m.target != "direct" else None,
                    "runs": [asdict(r) for r in m.runs],
                }
                for m in results.values()
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(results, cells, targets))
    print(c1_latency(results, cells, targets))
    print(f"\nload average before {' '.join(load_before)}, after {' '.join(load_after)}")
    if failures:
        print(f"FAILED: {failures} requests failed (wrk socket errors or non-2xx)", file=sys.stderr)
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
