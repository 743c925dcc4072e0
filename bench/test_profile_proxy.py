"""Self-checks of profile_proxy's bucket rules (not in the default test run: ``pytest bench/test_profile_proxy.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_proxy import aggregate

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
