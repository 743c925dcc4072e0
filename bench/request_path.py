"""The router's own CPU per request, in process, without sockets: what our Python costs, apart from the
kernel, the workers and the machine's noise.

The real router (``RouterCore``, its server and dispatcher, the lean upstream client) serves a loop of requests
whose transports are fakes: the client's connection is fed the bytes of ``bench/wrk/post.lua``'s requests (~1 KB,
one of 8 shared documents then a distinct question), and each upstream connection answers every request it is sent
at once, in the next turn of the loop, with the bytes an ``smg-sim`` worker sends: a whole answer in one read, or
a stream of SSE chunks in four reads, one a turn of the loop (a worker's stream came in about three reads a request
at c=64, counted in the real router).  Everything between is the router's: parsing, admission, the policy and its
tree, the attempt guard, metrics, the relay, the answer's head.  Not measured: system calls, the event loop's own
I/O, the background tasks (load monitor, health checks, tree upkeep).  The figure is a loop's wall time over its
requests, best of ``--reps``: compare variants and commits here, then confirm with ``bench_proxy.py`` on real
sockets, where a request costs the router 2.5 (c=64) to 5 (c=1) times this figure (round_robin chat
40 µs here, 100 and 208 µs there): the system calls, the loop's own I/O, and caches the workers left cold.

    .venv/bin/python bench/request_path.py [--policy cache_aware] [--endpoint chat] [--stream]
        [--requests 20000] [--reps 5] [--router-commit REV]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "bench-model"
WORKERS = ("http://127.0.0.1:18101", "http://127.0.0.1:18102")
DOCS = [
    f"You are assistant number {i} of the benchmark fleet. "
    + "".join(f"Rule {i}.{j}: answer briefly, cite the document, keep the tone even. " for j in range(1, 12))
    for i in range(1, 9)
]
"""The shared documents of ``bench/wrk/post.lua``."""


def _json_string(s: str) -> str:
    import json

    return json.dumps(s)


def request_bytes(endpoint: str, stream: bool, n: int) -> bytes:
    """The n-th request of ``post.lua``, as wrk sends it."""
    doc = DOCS[n % 8]
    question = (
        f"Question bench-{n}: what does the document above say about item {n % 97}, and why does it matter here? "
        "Answer in one line."
    )
    flag = "true" if stream else "false"
    if endpoint == "generate":
        path = "/generate"
        body = (
            f'{{"text":{_json_string(doc + chr(10) + chr(10) + question)},'
            f'"sampling_params":{{"max_new_tokens":4,"temperature":0}},"stream":{flag}}}'
        )
    else:
        path = "/v1/chat/completions"
        body = (
            f'{{"model":"{MODEL}","messages":[{{"role":"system","content":{_json_string(doc)}}},'
            f'{{"role":"user","content":{_json_string(question)}}}],"max_tokens":2,"temperature":0,"stream":{flag}}}'
        )
    raw = body.encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


def answer_reads(endpoint: str, stream: bool) -> list[bytes]:
    """What a worker (``smg-sim``) sends back, one element per read the router makes."""
    if not stream:
        body = (
            b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"bench-model","choices":[{"index":0,'
            b'"message":{"role":"assistant","content":"ok ok"},"finish_reason":"length"}],"usage":{"prompt_tokens":'
            b'250,"completion_tokens":2,"total_tokens":252}}'
        )
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Date: Sat, 05 Dec 2026 08:22:05 GMT\r\nServer: Python/3.11 aiohttp/3.14.5\r\n"
            b"x-smg-sim-worker: 127.0.0.1:18101\r\n\r\n" % len(body)
        )
        return [head + body]
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\nDate: Sat, 05 Dec 2026 08:22:05 GMT\r\n"
        b"Server: Python/3.11 aiohttp/3.14.5\r\nx-smg-sim-worker: 127.0.0.1:18101\r\n\r\n"
    )
    events = [
        b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
        for _ in range(4)
    ] + [b"data: [DONE]\n\n"]
    chunks = [b"%x\r\n%b\r\n" % (len(e), e) for e in events]
    return [head + chunks[0], chunks[1], chunks[2] + chunks[3], chunks[4] + b"0\r\n\r\n"]


class _Transport(asyncio.Transport):
    """A socket that is not one: ``write`` hands the bytes to ``on_write``."""

    def __init__(self, on_write: Callable[[bytes], None], sockname: tuple[str, int]) -> None:
        super().__init__()
        self._on_write = on_write
        self._sockname = sockname
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._on_write(bytes(data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sockname":
            return self._sockname
        if name == "socket":
            return _Socket()
        return default

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


class _Socket:
    family = socket.AF_UNIX
    """Not TCP: the server sets no receive low-water mark on it."""

    def fileno(self) -> int:
        return os.open(os.devnull, os.O_RDONLY)  # the lean client polls it before a reuse: never readable


async def serve(argv: list[str], endpoint: str, stream: bool, count: int, reps: int) -> list[float]:
    """Seconds per request of each repetition."""
    from smg_router import app
    from smg_router.settings import parse_settings
    from smg_router.upstream import lean
    from smg_router.workers.worker import WorkerSpec, WorkerStatus

    loop = asyncio.get_running_loop()
    settings = parse_settings(["--worker-urls", *WORKERS, *argv])
    core = app.RouterCore(settings)
    for url in WORKERS:
        worker, _ = core.fleet.lifecycle.add(WorkerSpec.from_json({"url": url, "model_id": MODEL}))
        worker.status = WorkerStatus.READY
        core.loads.record(worker.id, 0, at=time.monotonic())
        core.loads.record_kv(worker.id, 200_000)
    server = app.build_server(core)
    reads = answer_reads(endpoint, stream)
    requests = [request_bytes(endpoint, stream, n) for n in range(count * (reps + 1) + reps + 2)]

    async def connect(key: tuple[str, int]) -> lean._Conn:
        conn = lean._Conn(key, lean_client._timeouts)

        def answer(_: bytes) -> None:
            loop.call_soon(deliver, 0)

        def deliver(i: int) -> None:  # a read each turn of the loop, as a worker's stream arrives on a socket
            conn.data_received(reads[i])
            if i + 1 < len(reads):
                loop.call_later(0, deliver, i + 1)

        conn.connection_made(_Transport(answer, ("127.0.0.1", 40000)))
        return conn

    lean_client = core.upstream._lean
    lean_client._connect = connect  # type: ignore[method-assign]
    lean.select.poll = _NeverReadable  # type: ignore[attr-defined,misc]
    client = server_conn = None
    results: list[float] = []
    next_request = 0
    done: asyncio.Future[None] | None = None
    answered = failed = 0
    starting = True
    goal = 0

    def on_answer(data: bytes) -> None:
        nonlocal answered, next_request, failed, starting
        if starting and not data.startswith(b"HTTP/1.1 200 "):
            failed += 1  # every answer must be the worker's, relayed: a benchmark of error answers measures nothing
        starting = False
        if stream and not data.endswith(b"0\r\n\r\n"):
            return
        starting = True
        if stream and b"data: [DONE]" not in data:
            failed += 1
        answered += 1
        if answered >= goal:
            assert done is not None
            if not done.done():
                done.set_result(None)
            return
        next_request += 1
        loop.call_soon(server_conn.data_received, requests[next_request])

    from smg_router.server import _Connection

    server_conn = _Connection(server)
    client = _Transport(on_answer, ("127.0.0.1", 8080))
    server_conn.connection_made(client)
    for rep in range(reps + 1):
        answered = 0
        goal = count
        done = loop.create_future()
        gc.collect()
        t0 = time.perf_counter()
        next_request += 1
        server_conn.data_received(requests[next_request])
        await done
        seconds = time.perf_counter() - t0
        if rep:  # the first one warms up
            results.append(seconds / count)
    if failed:
        raise SystemExit(f"request_path: {failed} answers were not the worker's 200 (see the router's log above)")
    return results


class _NeverReadable:
    """``select.poll`` for the fake sockets: nothing is ever waiting on an idle connection."""

    def register(self, fd: int, mask: int) -> None:
        os.close(fd)

    def poll(self, timeout: float) -> list[Any]:
        return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--endpoint", choices=("chat", "generate"), default="chat")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--router-commit", help="measure smg-router as of this git revision (default: the working tree)")
    p.add_argument("--router-arg", action="append", default=[], help="an extra router flag (repeatable)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's N costliest functions")
    args = p.parse_args()
    code = ROOT / "router"
    if args.router_commit:
        tmp = Path(tempfile.mkdtemp(prefix="request-path-"))
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.router_commit, "router"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        code = tmp / "router"
    sys.path.insert(0, str(code))
    import uvloop

    argv = ["--policy", args.policy, "--log-level", "warning", *args.router_arg]
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
    per = uvloop.run(serve(argv, args.endpoint, args.stream, args.requests, args.reps))
    if args.profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    us = sorted(x * 1e6 for x in per)
    print(
        f"{args.policy} {args.endpoint}{' stream' if args.stream else ''}: {us[0]:.1f} µs a request "
        f"(best of {args.reps}; median {us[len(us) // 2]:.1f}, worst {us[-1]:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
