"""Real processes on loopback for integration tests: smg-sim workers and smg-router instances.

Each simulated worker gets its own 127.0.0.x address (as pods get their own IPs).  Every process logs
to a file under the test's tmp dir and is terminated (then killed) at teardown.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

import aiohttp

_hosts = itertools.cycle(range(2, 250))
MODEL = "sim-model"


def next_host() -> str:
    """A fresh loopback address per worker (127.0.0.2 ... 127.0.0.249, then around again)."""
    return f"127.0.0.{next(_hosts)}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports (for processes that must know each other's before they start)."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port(host)) not in ports:
            ports.append(port)
    return ports


def http_json(
    method: str, url: str, body: Any = None, *, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, Any]:
    """A tiny blocking HTTP client for fixtures and assertions (no event loop needed)."""
    status, parsed, _ = _http(method, url, body, headers=headers, timeout=timeout)
    return status, parsed


def http_json_headers(
    method: str, url: str, body: Any = None, *, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, Any, Message]:
    """``http_json`` with the response's headers too."""
    return _http(method, url, body, headers=headers, timeout=timeout)


@dataclass(frozen=True)
class Served:
    """A router's answer and the smg-sim worker that produced it (from its ``x-smg-sim-worker`` header)."""

    status: int
    body: Any
    worker_url: str | None


def _http(
    method: str, url: str, body: Any, *, headers: dict[str, str] | None, timeout: float
) -> tuple[int, Any, Message]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
            got = resp.headers
    except urllib.error.HTTPError as e:
        raw, status, got = e.read(), e.code, e.headers
    try:
        return status, json.loads(raw) if raw else None, got
    except ValueError:
        return status, raw.decode(errors="replace"), got


def wait_until(predicate, *, timeout: float = 15.0, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, urllib.error.URLError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def wait_until_async(
    predicate: Callable[[], Any | Awaitable[Any]],
    *,
    timeout: float = 15.0,  # noqa: ASYNC109 - a polling deadline whose error names `what` and the last value
    interval: float = 0.02,
    what: str = "condition",
) -> Any:
    """``wait_until`` inside an event loop: polls a sync or async predicate until it is truthy.

    The deadline is on the loop's clock, so under a virtual-time loop it is virtual too.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        try:
            result = predicate()
            last = await result if inspect.isawaitable(result) else result
        except (OSError, aiohttp.ClientError) as e:
            last = e
        else:
            if last:
                return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@dataclass
class Proc:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        self._log.close()
        self.popen = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Sim(Proc):
    host: str = ""
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Router(Proc):
    host: str = "127.0.0.1"
    port: int = 0
    admin_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def admin(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        return http_json(method, self.url + path, body, headers=headers, **kw)

    def workers(self) -> list[dict[str, Any]]:
        status, body = http_json("GET", self.url + "/workers")
        assert status == 200, body
        return body["workers"]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()

    def complete(self, prompt: str, *, max_tokens: int = 1, timeout: float = 30.0, model: str = MODEL) -> Served:
        """``POST /v1/completions`` with ``prompt``: the answer and which worker served it."""
        status, body, headers = _http(
            "POST",
            self.url + "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": max_tokens},
            headers=None,
            timeout=timeout,
        )
        worker = headers.get("x-smg-sim-worker")
        return Served(status, body, f"http://{worker}" if worker else None)

    def worker(self, url: str) -> dict[str, Any]:
        """The ``GET /workers`` entry of the worker at ``url``."""
        (found,) = [w for w in self.workers() if w["url"] == url]
        return found

    def wait_routable(self, count: int, timeout: float = 15.0) -> None:
        wait_until(
            lambda: sum(w["routable"] for w in self.workers()) == count,
            timeout=timeout,
            what=f"{count} routable workers on {self.url}",
        )


def sim_args(
    host: str, port: int, *, model: str = MODEL, time_scale: float | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """The smg-sim command line serving ``model`` on ``host:port``: one spelling for the tests, the benchmarks and
    the soak.  ``time_scale`` None keeps the sim's own; ``extra`` flags come last."""
    args = [sys.executable, "-m", "smg_sim", "--host", host, "--port", str(port), "--model", model]
    if time_scale is not None:
        args += ["--time-scale", str(time_scale)]
    return [*args, *extra]


def start_sim(
    tmp: Path,
    *,
    model: str = MODEL,
    host: str | None = None,
    extra: list[str] | None = None,
    time_scale: float = 0.05,
    port: int | None = None,
) -> Sim:
    """An smg-sim process logging under ``tmp``, serving once this returns (stopped if it never does)."""
    host = host or next_host()
    port = port or free_port(host)
    args = sim_args(host, port, model=model, time_scale=time_scale, extra=extra or ())
    sim = Sim(name=f"sim-{host}-{port}", args=args, log_path=tmp / f"sim-{host}-{port}.log", host=host, port=port)
    sim.start()
    try:
        wait_until(
            lambda: http_json("GET", sim.url + "/health", timeout=1)[0] == 200 or not sim.alive(),
            what=f"smg-sim {sim.url}",
        )
    except AssertionError:
        sim.stop()
        raise
    assert sim.alive(), sim.log()
    return sim


def start_router(
    tmp: Path,
    *,
    workers: list[str] | tuple[str, ...] = (),
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    admin_key: str | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
) -> Router:
    """An smg-router process logging under ``tmp``, serving once this returns.  Its answers name the routed worker's
    URL (``--expose-worker-url``, off by default in the router), which tests read; ``env`` may turn it off."""
    port = port or free_port(host)
    argv = [
        sys.executable,
        "-m",
        "smg_router",
        "--host",
        host,
        "--port",
        str(port),
        "--health-check-interval",
        "0.3",
        "--load-monitor-interval",
        "0.2",
        "--shutdown-delay",
        "0",
        *(args or []),
    ]  # no endpoints to drain from here; a test may set its own
    if workers:
        argv += ["--worker-urls", *workers]
    if admin_key:
        argv += ["--admin-api-key", admin_key]
    router = Router(
        name=f"router-{host}-{port}",
        args=argv,
        log_path=tmp / f"router-{host}-{port}.log",
        env={"SMG_EXPOSE_WORKER_URL": "1", **(env or {})},  # tests read the routed worker's URL; "" turns it off
        host=host,
        port=port,
        admin_key=admin_key,
    )
    router.start()
    try:
        wait_until(
            lambda: http_json("GET", router.url + "/liveness", timeout=1)[0] == 200 or not router.alive(),
            what=f"smg-router {router.url}",
        )
    except AssertionError:
        router.stop()
        raise
    assert router.alive(), router.log()
    return router


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, label_text = head.partition("{")
        if sample != name:
            continue
        pairs = dict(p.split("=", 1) for p in label_text.rstrip("}").split(",") if "=" in p)
        pairs = {k: v.strip('"') for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total
