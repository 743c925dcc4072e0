"""The `smg-demo` command: a local SMG fleet in one command.

Starts N smg-sim workers as subprocesses on 127.0.0.2, 127.0.0.3, ... (all of 127/8 is loopback, so each
worker has its own address and the same port, like pods in a cluster), waits until they are healthy,
then runs the router (`python -m smg_router`, launched by module name: this package never imports the
router) in front of them. SIGINT/SIGTERM are forwarded and every child is stopped on exit.

A worker that exits while the demo runs is reported and restarted on the same address (so that killing
one shows the router's fault handling instead of ending the demo); only the router's exit ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

#: Seconds given to children to exit after SIGTERM before they are killed.
STOP_GRACE_S = 5.0
#: Seconds before a lost worker is restarted: long enough to see the router route around it.
RESTART_DELAY_S = 2.0
#: The longest restart delay: a worker that keeps dying is retried this often, not in a storm.
RESTART_DELAY_MAX_S = 30.0
#: A worker that ran at least this long before it exited is restarted after RESTART_DELAY_S again.
STABLE_RUN_S = 10.0
#: The router's health-check interval in the demo: a lost worker leaves and rejoins /workers within seconds.
HEALTH_CHECK_INTERVAL_S = 1.0


def worker_hosts(count: int) -> list[str]:
    """127.0.0.2, 127.0.0.3, ...: one loopback address per worker."""
    if not 1 <= count <= 250:
        raise ValueError("workers must be between 1 and 250")
    return [f"127.0.0.{2 + i}" for i in range(count)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smg-demo",
        description=(
            "Run smg-sim workers behind the SMG router. A worker that exits (kill one to watch the router route"
            f" around it) is restarted on its address after {RESTART_DELAY_S:g} s, backing off up to"
            f" {RESTART_DELAY_MAX_S:g} s if it keeps dying; the router's exit ends the demo."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=3, help="number of simulated workers")
    p.add_argument("--host", default="127.0.0.1", help="router address")
    p.add_argument("--port", type=int, default=30000, help="router port")
    p.add_argument("--model", default="smg-sim-model", help="served model name")
    p.add_argument("--policy", default="cache_aware", help="router load-balancing policy")
    p.add_argument("--worker-port", type=int, default=8000, help="port of every worker (each has its own IP)")
    p.add_argument("--time-scale", type=float, default=1.0, help="smg-sim --time-scale of the workers")
    p.add_argument("--max-running", type=int, default=16, help="smg-sim --max-running of the workers")
    p.add_argument("--no-router", action="store_true", help="only start the workers")
    p.add_argument("--health-timeout", type=float, default=30.0, help="seconds to wait for healthy workers")
    return p


def _healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(f"{url}/health", timeout=1.0) as resp:
            status: int = resp.status  # urlopen's response is untyped (Any) in typeshed
            return status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM everyone still running, then SIGKILL whoever outlives the grace period."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def restart_delay(previous: float | None, ran_for: float) -> float:
    """Seconds before restarting a worker that ran ``ran_for`` s: doubled from ``previous`` when it died soon
    after its last (re)start, so a worker that cannot stay up is not restarted in a storm."""
    if previous is None or ran_for >= STABLE_RUN_S:
        return RESTART_DELAY_S
    return min(RESTART_DELAY_MAX_S, previous * 2)


def _exit_status(returncode: int) -> str:
    """``signal 9`` for a killed child, ``code 1`` for one that exited by itself."""
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


def _describe(proc: subprocess.Popen[bytes]) -> str:
    """The child's role for messages: its module and first flags (``smg_sim --host 127.0.0.2``)."""
    args = proc.args
    if isinstance(args, list | tuple):
        return " ".join(map(str, args[2:5]))
    return str(args)


@dataclass
class _Worker:
    """One smg-sim child and what it takes to bring it back: its command, and when to restart it."""

    url: str
    cmd: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    delay: float | None = None
    """The last restart delay (None before the first loss): the back-off doubles it."""
    restart_at: float | None = None
    """When the lost worker is due to be restarted (None while it runs)."""

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd)
        self.started_at = time.monotonic()
        self.restart_at = None


class _Demo:
    """The running fleet: worker and router processes plus the stop flag set by signals."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workers: list[_Worker] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.stop = threading.Event()
        self.worker_urls = [f"http://{h}:{args.worker_port}" for h in worker_hosts(args.workers)]

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """Every child started so far that may still run (the current process of each worker)."""
        procs = [w.proc for w in self.workers if w.proc is not None]
        return procs + ([self.router] if self.router is not None else [])

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)
        self.stop.set()

    def start_workers(self) -> None:
        a = self.args
        for host, url in zip(worker_hosts(a.workers), self.worker_urls, strict=True):
            cmd = [
                sys.executable,
                "-m",
                "smg_sim",
                "--host",
                host,
                "--port",
                str(a.worker_port),
                "--model",
                a.model,
                "--time-scale",
                str(a.time_scale),
                "--max-running",
                str(a.max_running),
            ]
            worker = _Worker(url, cmd)
            self.workers.append(worker)
            worker.start()

    def wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.args.health_timeout
        pending = set(self.worker_urls)
        while pending and not self.stop.is_set():
            if any(p.poll() is not None for p in self.procs):
                print("smg-demo: a worker exited during start-up", file=sys.stderr)
                return False
            if time.monotonic() > deadline:
                print(
                    f"smg-demo: workers not healthy after {self.args.health_timeout}s: {sorted(pending)}",
                    file=sys.stderr,
                )
                return False
            pending = {u for u in pending if not _healthy(u)}
            if pending:
                self.stop.wait(0.1)
        return not pending

    def start_router(self) -> None:
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "smg_router",
            "--host",
            a.host,
            "--port",
            str(a.port),
            "--policy",
            a.policy,
            "--shutdown-delay",
            "0",
            "--health-check-interval",
            str(HEALTH_CHECK_INTERVAL_S),
            "--worker-urls",
            *self.worker_urls,
        ]
        self.router = subprocess.Popen(cmd)

    def wait_router(self) -> bool:
        """Until the router accepts connections (a TCP check: no assumption about its routes)."""
        assert self.router is not None
        deadline = time.monotonic() + self.args.health_timeout
        while not self.stop.is_set():
            if self.router.poll() is not None:
                print("smg-demo: the router exited during start-up", file=sys.stderr)
                return False
            address = (self.args.host, self.args.port)
            with contextlib.suppress(OSError), socket.create_connection(address, timeout=0.5):
                return True
            if time.monotonic() > deadline:
                print(f"smg-demo: router not listening after {self.args.health_timeout}s", file=sys.stderr)
                return False
            self.stop.wait(0.1)
        return False

    def print_banner(self) -> None:
        a = self.args
        target = self.worker_urls[0] if a.no_router else f"http://{a.host}:{a.port}"
        print(f"smg-demo: workers ready: {' '.join(self.worker_urls)}", flush=True)
        pids = " ".join(f"{w.url}={w.proc.pid}" for w in self.workers if w.proc is not None)
        print(f"smg-demo: worker pids: {pids} (kill one: the demo restarts it)", flush=True)
        if not a.no_router:
            print(f"smg-demo: router ({a.policy}) on {target}", flush=True)
        body = json.dumps({"model": a.model, "messages": [{"role": "user", "content": "Hello"}]})
        print(
            "smg-demo: try:\n"
            f"  curl -s {target}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{body}'\n"
            "smg-demo: ready (Ctrl-C to stop)",
            flush=True,
        )

    def tend_workers(self) -> None:
        """Report each newly lost worker and schedule its restart; restart those that are due."""
        if self.stop.is_set():
            return  # a Ctrl-C reaches the workers too: their exit is the demo's end, not a loss
        now = time.monotonic()
        for w in self.workers:
            if w.restart_at is None and w.proc is not None and w.proc.poll() is not None:
                w.delay = restart_delay(w.delay, now - w.started_at)
                w.restart_at = now + w.delay
                around = "" if self.args.no_router else "; the router routes around it"
                print(
                    f"smg-demo: worker {w.url} exited ({_exit_status(w.proc.returncode)}){around};"
                    f" restarting it in {w.delay:g} s",
                    flush=True,
                )
            elif w.restart_at is not None and now >= w.restart_at:
                w.start()
                assert w.proc is not None
                print(f"smg-demo: worker {w.url} restarted (pid {w.proc.pid})", flush=True)

    def wait(self) -> int:
        """Block until a signal (exit 0) or until the router dies (exit 1), restarting lost workers meanwhile."""
        while not self.stop.wait(0.2):
            if self.router is not None and self.router.poll() is not None:
                what = _describe(self.router)
                code = _exit_status(self.router.returncode)
                print(f"smg-demo: {what} exited ({code}); stopping", file=sys.stderr, flush=True)
                return 1
            self.tend_workers()
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    demo = _Demo(args)
    previous = {sig: signal.signal(sig, demo.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        demo.start_workers()
        if not demo.wait_healthy():
            return 0 if demo.stop.is_set() else 1
        if not args.no_router:
            demo.start_router()
            if not demo.wait_router():
                return 0 if demo.stop.is_set() else 1
        demo.print_banner()
        return demo.wait()
    finally:
        _stop_all(demo.procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("smg-demo: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
