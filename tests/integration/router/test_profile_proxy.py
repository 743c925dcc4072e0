"""The profiler of the request path (``bench/profile_proxy.py``, "where a request's time goes"): its
bucket rules on made-up stacks, then a short run of the tool itself (py-spy attached to a real router under wrk load,
smg-sim workers on loopback), whose samples must land in the buckets the rules name, not in "other".  Asserts
behaviour, not speed: the shares themselves are in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
_path = list(sys.path)
sys.path.insert(0, str(BENCH))  # bench_proxy puts bench/routing and tests first too: only for this import
try:
    from profile_proxy import BUCKETS, aggregate
finally:
    sys.path[:] = _path

SITE = "/v/lib/python3.11/site-packages"
START = "_run_code (<frozen runpy>:88);main (/r/smg_router/__main__.py:100);run (" + SITE + "/uvloop/__init__.py:92)"
LOOP = "Loop__run (/project/uvloop/loop.c:1);task_step (/b/Modules/_asynciomodule.c:2)"
HANDLER = (
    "RequestHandler._handle_request (" + SITE + "/aiohttp/web_protocol.py:602);Proxy.handle (/r/smg_router/proxy.py:9)"
)


def shares(*stacks: str) -> dict[str, int]:
    return dict(aggregate(f"{s} 1" for s in stacks)[0])


def test_the_leaf_most_code_frame_decides() -> None:
    tree = f"{START};{LOOP};{HANDLER};RadixTree._walk (/r/smg_router/tree/radix_tree.py:139)"
    inc = f"MutexValue.inc ({SITE}/prometheus_client/values.py:28)"
    metrics = f"{START};{LOOP};{HANDLER};inc (/r/smg_router/metrics.py:5);{inc}"
    assert shares(tree, metrics) == {"tree": 1, "metrics": 1}


def test_a_syscall_goes_to_the_code_that_made_it() -> None:
    send = "LeanUpstream._send (/r/smg_router/upstream/lean.py:390);write (/p/uvloop/loop.c:5);send (libc.so.6)"
    write = f"{START};{LOOP};{HANDLER};{send}"
    assert shares(write) == {"upstream client": 1}


def test_the_loop_alone_and_the_startup_frames_are_the_event_loop() -> None:
    assert shares(f"{START};{LOOP};epoll_pwait (libc.so.6)") == {"event loop": 1}


def test_a_collection_anywhere_is_gc() -> None:
    assert shares(f"{START};{LOOP};{HANDLER};gc_collect_main (/l/libpython3.11.so.1.0)") == {"GC": 1}


def test_httptools_is_charged_to_the_leg_that_parses() -> None:
    parse = "feed_data (/v/httptools/parser/parser.c:9)"
    server = f"{START};{LOOP};_Connection.data_received (/r/smg_router/server.py:110);{parse}"
    upstream = f"{START};{LOOP};_Conn.data_received (/r/smg_router/upstream/lean.py:80);{parse}"
    head = f"{START};{LOOP};{HANDLER};Response.encode_head (/r/smg_router/wire.py:250)"
    assert shares(server, upstream, head) == {"server": 2, "upstream client": 1}


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="py-spy attaches to the router with ptrace(2): needs root")
def test_a_short_profile_of_a_live_router_fills_the_named_buckets(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    args = ["--duration", "2", "--rate", "200", "--concurrency", "8", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "profile_proxy.py"), *args], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["cell"] == {"policy": "cache_aware", "endpoint": "chat", "stream": False, "c": 8}
    assert doc["rps"]["plain"] > 50 and doc["rps"]["profiled"] > 0
    samples = doc["samples"]
    total = sum(samples.values())
    assert total >= 40, samples  # the router was busy for a good part of 2 s at 200 Hz: its samples were taken
    assert set(samples) <= set(BUCKETS)
    assert samples.get("other", 0) <= 0.05 * total, doc["top_frames"].get("other")  # a stack no rule knows
    for name in ("server", "body parse", "policy", "tree", "upstream client", "router core", "event loop"):
        assert samples.get(name, 0) > 0, (name, samples)  # every leg of a cache-aware chat shows up
    for name, code in (("server", "(server.py:"), ("upstream client", "(upstream/lean.py:"), ("tree", "(tree/")):
        assert any(code in frame for frame, _ in doc["top_frames"][name]), (name, doc["top_frames"][name])
    assert "smg:cache_aware, chat, c=8: " in proc.stdout and "| total |" in proc.stdout
