"""Clients that send slowly, pipeline large bodies, trickle a multipart head or open many connections: a real router
on loopback, raw sockets on the client side, the router's own memory and CPU read from /proc.

Body bytes count as they arrive (never as a client declares them), each connection buffers a bounded amount,
heads and bodies have deadlines, connections are limited in all and per address; every refusal is a JSON error
and is counted (``smg_requests_rejected_total{reason}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from support.procs import MODEL, Router, metric_value, start_router, start_sim

MIB = 1 << 20


@contextlib.contextmanager
def _router(logs: Path, args: list[str], *, worker: bool = True, time_scale: float = 0.05) -> Iterator[Router]:
    """A router with ``args`` (over one smg-sim worker unless ``worker`` is False), stopped at the end."""
    sim = start_sim(logs, time_scale=time_scale) if worker else None
    try:
        router = start_router(logs, workers=[sim.url] if sim else [], args=args)
        try:
            if sim is not None:
                router.wait_routable(1)
            yield router
        finally:
            router.stop()
    finally:
        if sim is not None:
            sim.stop()


def _rss(router: Router) -> int:
    """The router's resident memory in bytes (VmRSS)."""
    assert router.popen is not None
    for line in Path(f"/proc/{router.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _cpu(router: Router) -> float:
    """The router's CPU seconds so far (utime + stime)."""
    assert router.popen is not None
    fields = Path(f"/proc/{router.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _address(router: Router) -> tuple[str, int]:
    host, port = router.url.removeprefix("http://").split(":")
    return host, int(port)


async def _complete(s: aiohttp.ClientSession, router: Router, prompt: str) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with s.post(router.url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


async def _answer(reader: asyncio.StreamReader, within: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the router's answer (read to the close)."""
    raw = await asyncio.wait_for(reader.read(), within)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, body


async def test_slow_bodies_hold_only_the_bytes_they_sent_and_other_requests_are_served(logs: Path) -> None:
    """16 clients each announce an 8 MiB body (the whole --max-inflight-bytes together) and send 3 bytes of it:
    what they hold is 48 bytes, so every other request is still served while they trickle."""
    writers = []
    with _router(logs, ["--max-inflight-bytes", str(128 * MIB)]) as r:
        host, port = _address(r)
        for _ in range(16):
            _, writer = await asyncio.open_connection(host, port)
            writer.write(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {8 * MIB}\r\n\r\n".encode()
                + b'{"p'
            )
            writers.append(writer)
        await asyncio.sleep(0.5)  # every slow request admitted and reading
        async with aiohttp.ClientSession() as s:
            statuses = [await _complete(s, r, f"served while they trickle {i}") for i in range(10)]
        assert statuses == [200] * 10
        text = await asyncio.to_thread(r.metrics)
        assert metric_value(text, "smg_requests_rejected_total", reason="inflight_bytes") == 0
        for writer in writers:
            writer.close()


async def test_a_body_slower_than_the_minimum_rate_is_408_though_no_gap_reaches_the_body_timeout(logs: Path) -> None:
    with _router(logs, ["--head-timeout", "1", "--body-min-rate", "1000"]) as r:
        reader, writer = await asyncio.open_connection(*_address(r))
        writer.write(POST_HEAD % 5000)
        started = time.monotonic()
        answered = asyncio.ensure_future(_answer(reader, within=15))
        while not answered.done() and time.monotonic() - started < 10:
            writer.write(b" ")  # a byte every 0.2 s: no gap near --body-timeout (60 s), far below 1000 bytes/s
            await asyncio.sleep(0.2)
        status, _, body = await answered
        took = time.monotonic() - started
        assert status == 408, body
        error = json.loads(body)["error"]
        assert error["code"] == "request_body_too_slow" and "--body-min-rate" in error["message"], error
        assert 1.0 <= took < 4.0, took  # the 1 s grace, a few bytes' worth, and one sweep
        writer.close()
        text = await asyncio.to_thread(r.metrics)
        assert metric_value(text, "smg_requests_rejected_total", reason="body_too_slow") == 1


async def test_a_head_that_does_not_arrive_within_the_head_timeout_is_408(logs: Path) -> None:
    with _router(logs, ["--head-timeout", "1"], worker=False) as r:
        reader, writer = await asyncio.open_connection(*_address(r))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        answered = asyncio.ensure_future(_answer(reader, within=15))
        while not answered.done() and time.monotonic() - started < 10:
            writer.write(b"X")  # a header that never ends, a byte every 0.2 s
            await asyncio.sleep(0.2)
        status, _, body = await answered
        assert status == 408 and json.loads(body)["error"]["code"] == "request_head_timeout", body
        assert time.monotonic() - started < 4.0
        writer.close()
        silent_reader, silent = await asyncio.open_connection(*_address(r))  # a connection that sends nothing
        status, _, body = await _answer(silent_reader, within=5)
        assert status == 408, body
        silent.close()
        text = await asyncio.to_thread(r.metrics)
        assert metric_value(text, "smg_requests_rejected_total", reason="head_timeout") == 2


async def test_pipelined_bodies_stay_within_the_body_budget_and_new_requests_are_admitted(logs: Path) -> None:
    """8 connections each send a slow request, then 15 pipelined requests of 1 MiB behind it: the router reads a
    bounded amount of what waits behind the slow one, its memory stays within --max-inflight-bytes (plus the
    runtime's own), and a new request is served meanwhile."""
    writers = []
    with _router(logs, ["--max-inflight-bytes", str(16 * MIB)], time_scale=1.0) as r:
        async with aiohttp.ClientSession() as s:
            assert await _complete(s, r, "warm up") == 200
        baseline = _rss(r)
        host, port = _address(r)
        slow = json.dumps({"model": MODEL, "prompt": "slow", "max_tokens": 600}).encode()
        big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * (MIB - 64) + b'", "max_tokens": 1}'
        for _ in range(8):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(POST_HEAD % len(slow) + slow + b"".join(POST_HEAD % len(big) + big for _ in range(15)))
            writers.append((reader, writer))
        peak = baseline
        for _ in range(20):  # 2 s while the slow requests generate and the pipelined bodies wait
            await asyncio.sleep(0.1)
            peak = max(peak, _rss(r))
        async with aiohttp.ClientSession() as s:
            assert await _complete(s, r, "a new request meanwhile") == 200
        peak = max(peak, _rss(r))
        grown = (peak - baseline) / MIB
        print(f"router RSS {baseline / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB (+{grown:.1f} MiB)")
        for _, writer in writers:
            writer.close()
        assert grown < 16 + 8, f"the router grew {grown:.1f} MiB with 120 MiB of pipelined bodies waiting"


def _trickle_head(address: tuple[str, int], head_bytes: int, piece: int, pause: float) -> bytes:
    """Send the first ``head_bytes`` of a multipart form of small fields (no file part) in ``piece``-byte writes,
    ``pause`` seconds apart (longer than the router takes for one: it reads them one by one, as from a far client),
    then the rest past the router's 64 KiB head limit at once; the router's answer."""
    boundary = b"XyZ"
    form = b"".join(
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv%d\r\n' % (i, i)
        for i in range(70 * 1024 // 40)
    )
    with socket.create_connection(address) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(
            b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=XyZ\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(form) + 1000)
        )
        for at in range(0, head_bytes, piece):
            sock.sendall(form[at : at + piece])
            time.sleep(pause)
        sock.sendall(form[head_bytes:])  # past the head limit: the router answers
        sock.settimeout(30)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and answer.endswith(b"}}"):
                break
        return answer


@pytest.mark.timeout(240)
async def test_a_multipart_head_in_tiny_pieces_costs_the_router_time_in_proportion_to_its_size(logs: Path) -> None:
    """A scan of the whole head at each piece cost seconds for 64 KiB in 64-byte pieces, and sixteen times that
    for a head four times as long; scanned once as it arrives, the cost follows the bytes."""
    with _router(logs, []) as r:
        costs = {}
        for size, piece, pause in ((16 * 1024, 4, 0.0003), (64 * 1024, 4, 0.0003), (64 * 1024, 64, 0.002)):
            before = _cpu(r)
            answer = await asyncio.to_thread(_trickle_head, _address(r), size, piece, pause)
            costs[size, piece] = _cpu(r) - before
            assert answer.startswith(b"HTTP/1.1 400 ") and b"invalid_multipart" in answer, answer[:300]
        print(" ".join(f"{s // 1024} KiB in {p}-byte pieces: {c * 1000:.0f} ms" for (s, p), c in costs.items()))
        assert costs[64 * 1024, 64] < 0.25, costs  # a scan of the whole head at each piece: 2 s
        # a wake-up per 4-byte piece cost 0.3 s (16384 of them); one per batch, about 60 ms (the idle router's polls
        # over the trickle's 6 s included)
        assert costs[64 * 1024, 4] < 0.25, costs
        assert costs[64 * 1024, 4] < 4 * costs[16 * 1024, 4] * 2 + 0.1, costs  # linear: about 4x, quadratic 16x


def _trickle_json(address: tuple[str, int], size: int, piece: int, pause: float) -> bytes:
    """A ``size``-byte completion request body sent in ``piece``-byte writes, ``pause`` seconds apart; the answer."""
    body = b'{"model": "%s", "max_tokens": 1, "prompt": "%s"}' % (MODEL.encode(), b"a" * (size - 64))
    body += b" " * (size - len(body))
    with socket.create_connection(address) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(POST_HEAD % len(body))
        for at in range(0, len(body), piece):
            sock.sendall(body[at : at + piece])
            time.sleep(pause)
        sock.settimeout(30)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


async def test_a_json_body_in_tiny_pieces_is_served_and_costs_the_router_milliseconds(logs: Path) -> None:
    """The pieces wait in the kernel until the reader can use them (or the body ends): 64 KiB in 4-byte pieces cost
    0.35 s of the router's CPU when each woke it, about 60 ms (its idle polls included) with a wake-up per batch."""
    with _router(logs, []) as r:
        before = _cpu(r)
        answer = await asyncio.to_thread(_trickle_json, _address(r), 64 * 1024, 4, 0.0003)
        cost = _cpu(r) - before
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        print(f"64 KiB of JSON in 4-byte pieces: {cost * 1000:.0f} ms")
        assert cost < 0.25, cost


async def test_a_body_whose_pieces_wait_unread_still_counts_them_against_its_timeouts(logs: Path) -> None:
    """Pieces held in the kernel below what the reader waits for have arrived: a body sent steadily for several
    --body-timeout and --head-timeout periods, above --body-min-rate, is served (no 408)."""
    with _router(logs, ["--body-timeout", "1", "--head-timeout", "1", "--body-min-rate", "100"]) as r:
        started = time.monotonic()
        answer = await asyncio.to_thread(_trickle_json, _address(r), 1000, 4, 0.02)  # about 200 bytes/s for 5 s
        assert time.monotonic() - started > 3.0  # several body timeouts and sweeps passed while it trickled
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        text = await asyncio.to_thread(r.metrics)
        assert metric_value(text, "smg_requests_rejected_total", reason="body_timeout") == 0
        assert metric_value(text, "smg_requests_rejected_total", reason="body_too_slow") == 0


async def test_connections_past_the_limits_get_a_503_and_are_closed(logs: Path) -> None:
    held: list[asyncio.StreamWriter] = []
    with _router(logs, ["--max-connections", "6", "--max-connections-per-client", "4"], worker=False) as r:
        host, port = _address(r)
        await asyncio.sleep(0.3)  # the start-up probes' connections are gone
        for _ in range(4):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            held.append(writer)
        reader, writer = await asyncio.open_connection(host, port)  # a fifth from the same address
        writer.write(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await _answer(reader, within=5)
        assert status == 503 and headers["retry-after"] == "1", body
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and "--max-connections-per-client" in error["message"]
        writer.close()
        for _ in range(2):  # another address still gets in, up to the limit in all
            reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.3", 0))
            writer.write(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            held.append(writer)
        reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.3", 0))
        status, _, body = await _answer(reader, within=5)
        assert status == 503 and "--max-connections)" in json.loads(body)["error"]["message"], body
        writer.close()
        for writer in held:
            writer.close()
        held.clear()
        await asyncio.sleep(0.3)
        text = await asyncio.to_thread(r.metrics)  # room again
        assert metric_value(text, "smg_requests_rejected_total", reason="too_many_connections") == 2
