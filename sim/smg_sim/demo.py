"""The `smg-demo` command: a local SMG fleet in one command.

Starts N smg-sim workers as subprocesses on 127.0.0.2, 127.0.0.3, ... (all of 127/8 is loopback, so each
worker has its own address and the same port, like pods in a cluster), waits until they are healthy,
then runs the router (`python -m smg_router`, launched by module name: this package never imports the
router) in front of them. SIGINT/SIGTERM are forwarded and every child is stopped on exit.
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
from types import FrameType

#: Seconds given to children to exit after SIGTERM before they are killed.
STOP_GRACE_S = 5.0


def worker_hosts(count: int) -> list[str]:
    """127.0.0.2, 127.0.0.3, ...: one loopback address per worker."""
    if not 1 <= count <= 250:
        raise ValueError("workers must be between 1 and 250")
    return [f"127.0.0.{2 + i}" for i in range(count)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smg-demo",
        description="Run smg-sim workers behind the SMG router.",
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


def _describe(proc: subprocess.Popen[bytes]) -> str:
    """The child's role for messages: its module and first flags (``smg_sim --host 127.0.0.2``)."""
    args = proc.args
    if isinstance(args, list | tuple):
        return " ".join(map(str, args[2:5]))
    return str(args)


class _Demo:
    """The running fleet: child processes plus the stop flag set by signals."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stop = threading.Event()
        self.worker_urls = [f"http://{h}:{args.worker_port}" for h in worker_hosts(args.workers)]

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)
        self.stop.set()

    def start_workers(self) -> None:
        a = self.args
        for host in worker_hosts(a.workers):
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
            self.procs.append(subprocess.Popen(cmd))

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
            "--worker-urls",
            *self.worker_urls,
        ]
        self.procs.append(subprocess.Popen(cmd))

    def wait_router(self) -> bool:
        """Until the router accepts connections (a TCP check: no assumption about its routes)."""
        deadline = time.monotonic() + self.args.health_timeout
        while not self.stop.is_set():
            if self.procs[-1].poll() is not None:
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

    def wait(self) -> int:
        """Block until a signal (exit 0) or until a child dies (exit 1)."""
        while not self.stop.wait(0.2):
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                what = _describe(dead[0])
                print(f"smg-demo: {what} exited with {dead[0].returncode}; stopping", file=sys.stderr, flush=True)
                return 1
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
