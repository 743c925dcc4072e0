"""The event-loop lag metric sees a stall of the router process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from support.procs import metric_value, start_router, wait_until


def test_a_stalled_event_loop_shows_in_the_lag_histogram(logs: Path) -> None:
    r = start_router(logs)
    try:
        wait_until(
            lambda: metric_value(r.metrics(), "smg_event_loop_lag_seconds_count") >= 2, what="the lag probe to run"
        )
        assert metric_value(r.metrics(), "smg_event_loop_lag_seconds_bucket", le="0.25") >= 1
        before = metric_value(r.metrics(), "smg_event_loop_lag_seconds_sum")
        assert r.popen is not None
        os.kill(r.popen.pid, signal.SIGSTOP)  # the whole process stops, as under a long synchronous stall
        time.sleep(0.6)
        os.kill(r.popen.pid, signal.SIGCONT)
        wait_until(
            lambda: metric_value(r.metrics(), "smg_event_loop_lag_seconds_sum") - before >= 0.3,
            what="the stall to be measured",
        )
    finally:
        r.stop()
