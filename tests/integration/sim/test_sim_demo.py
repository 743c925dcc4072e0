"""`smg-demo --no-router`: starts its workers on 127.0.0.2+, reports ready, and cleans up on SIGINT."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from smg_sim_procs import free_port, http_get


@pytest.fixture
def demo_port() -> int:
    return free_port("127.0.0.2", "127.0.0.3")


@contextlib.contextmanager
def run_demo(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "smg_sim.demo", *args], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the demo and the workers it started
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def read_until(proc: subprocess.Popen[bytes], marker: str, within_s: float) -> str:
    """Unbuffered reads of the demo's stdout until `marker` appears (or fail after `within_s`)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + within_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.1):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                seen += chunk
                if marker.encode() in seen:
                    return seen.decode()
    raise AssertionError(f"{marker!r} not printed; got {seen.decode(errors='replace')!r}")


def test_demo_starts_workers_and_stops_them(demo_port: int) -> None:
    urls = [f"http://127.0.0.2:{demo_port}", f"http://127.0.0.3:{demo_port}"]
    with run_demo(
        "--no-router",
        "--workers",
        "2",
        "--worker-port",
        str(demo_port),
        "--time-scale",
        "0.01",
        "--model",
        "demo-model",
    ) as proc:
        out = read_until(proc, "Ctrl-C to stop", within_s=20)
        assert all(url in out for url in urls)
        assert "curl" in out and "demo-model" in out
        for url in urls:
            assert http_get(f"{url}/health")[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
        for url in urls:
            with pytest.raises(OSError):
                http_get(f"{url}/health", timeout=0.5)
