"""Helpers to run smg-sim as real subprocesses on loopback addresses (127.0.0.2 and up).

A uniquely named top-level module (not `conftest`) so test modules can import it without packages.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from support.procs import sim_args

START_TIMEOUT_S = 15.0


def free_port(*hosts: str) -> int:
    """A port that is free on every given loopback host right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        ok = True
        for host in hosts[1:]:
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no common free port")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET without any proxy (the traffic must stay on loopback); returns (status, body)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@dataclass
class SimProcess:
    """One smg-sim subprocess."""

    host: str
    port: int
    proc: subprocess.Popen[bytes]
    bootstrap_port: int | None = None
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def worker_id(self) -> str:
        return f"{self.host}:{self.port}"

    def wait_serving(self) -> None:
        """Until the HTTP server answers (any status: /health may be 503 during --slow-start)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg-sim exited early with {self.proc.returncode}: {self.args}")
            with contextlib.suppress(OSError):
                http_get(f"{self.url}/v1/models", timeout=0.5)
                return
            time.sleep(0.05)
        raise RuntimeError(f"smg-sim did not start within {START_TIMEOUT_S}s: {self.args}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


SimLauncher = Callable[..., SimProcess]


@contextlib.contextmanager
def launcher() -> Iterator[SimLauncher]:
    """``launch(host, *flags, role=..., with_bootstrap=...)`` for the block; every process it started is killed
    when the block ends (a test's or a module's fixture)."""
    started: list[SimProcess] = []

    def launch(host: str, *extra: str, role: str = "regular", with_bootstrap: bool = False) -> SimProcess:
        port = free_port(host)
        bootstrap_port = free_port(host) if with_bootstrap else None
        args = sim_args(host, port, extra=["--role", role, "--log-level", "warning", *extra])
        if bootstrap_port is not None:
            args += ["--bootstrap-port", str(bootstrap_port)]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        sim = SimProcess(host=host, port=port, proc=proc, bootstrap_port=bootstrap_port, args=args)
        started.append(sim)
        sim.wait_serving()
        return sim

    try:
        yield launch
    finally:
        for sim in started:
            sim.kill()


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` as JSON: the status and the parsed answer (whatever its content type)."""
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)
