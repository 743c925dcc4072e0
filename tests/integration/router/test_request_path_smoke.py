"""The in-process request path benchmark's smoke run (``bench/request_path.py``): the real router, fake sockets,
every answer the worker's 200 relayed whole or as a stream, for each policy family.  Asserts behaviour, not speed:
the figures are in docs/benchmarks.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "request_path.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), "--requests", "300", "--reps", "1", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
@pytest.mark.parametrize("shape", [("--endpoint", "chat"), ("--endpoint", "generate", "--stream")])
def test_every_request_is_answered_and_timed(policy: str, shape: tuple[str, ...]) -> None:
    proc = run("--policy", policy, *shape)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.fullmatch(rf"{policy} \w+( stream)?: \d+\.\d µs a request \(best of 1; .*\)\n", proc.stdout), proc.stdout


def test_answers_that_are_not_the_workers_fail_the_run() -> None:
    proc = run("--policy", "round_robin", "--router-arg=--api-key=secret")  # every request a 401 from the router
    assert proc.returncode == 1
    assert "600 answers were not the worker's 200" in proc.stderr  # the warm-up's and the measured repetition's
