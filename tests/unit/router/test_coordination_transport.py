"""What a replica queues for its peers (``coordination.PeerSync``): the first prefills its requests lead, and their
ends."""

from __future__ import annotations

from smg_router.coordination.transport import PeerSync, _Peer
from smg_router.metrics import Metrics

W = "http://127.0.0.2:8000"


def _sync() -> tuple[PeerSync, _Peer]:
    sync = PeerSync(urls=[], dns=None, metrics=Metrics())
    peer = sync._peers["http://127.0.0.1:9"] = _Peer("http://127.0.0.1:9")
    return sync, peer


def test_a_prefill_that_ends_before_its_start_went_out_is_told_by_its_end_alone() -> None:
    """The end goes instead of the start: a peer whose claim this router answered with that lead knows of it (and
    waits for its end) without the start."""
    sync, peer = _sync()
    sync.tell_prefill(W, "doc A", done=False)
    sync.tell_prefill(W, "doc B", done=False)
    sync.tell_prefill(W, "doc A", done=True)  # before the batch: doc A's end replaces its start
    assert [(k, done) for k, (done, _) in peer.prefills.items()] == [((W, "doc A"), True), ((W, "doc B"), False)]
    peer.prefills.clear()
    peer.prefills.clear()  # the batch went out with doc B's start
    sync.tell_prefill(W, "doc B", done=True)
    assert [(k, done) for k, (done, _) in peer.prefills.items()] == [((W, "doc B"), True)]  # told: so is its end
    sync.tell_prefill(W, "doc B", done=False)  # a new lead before that end went out: the peer's lead goes on
    assert not peer.prefills
    assert not peer.hurry.is_set()  # told starts wait for the batch delay like routes; only a claim hurries


def test_a_peer_that_is_this_router_is_told_nothing_and_a_prefix_too_long_for_a_batch_is_not_told() -> None:
    sync, peer = _sync()
    peer.is_self = True
    sync.tell_prefill(W, "doc A", done=False)
    assert not peer.prefills
    peer.is_self = False
    sync.tell_prefill(W, "x" * (sync._batch_chars + 1), done=False)  # cut, it would name another prefix
    assert not peer.prefills


async def test_a_claim_is_answered_once_every_peer_answered_with_the_ids_of_those_that_lead_the_same() -> None:
    """``claim``: the start goes to every peer at once; the answer comes when the last peer answered the batch that
    carried it, with the ids of the peers that said they lead the same; a peer of an older version (no id, no
    leads), one whose answer is garbage and one that cannot be reached count as answers that lead nothing."""
    import asyncio
    import socket

    from aiohttp import web

    bodies: list[dict[str, object]] = []

    async def leader(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response({"applied": 1, "ignored": 0, "id": "a", "leads": [[W, "doc A"], ["x"], [1, 2]]})

    async def older(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"applied": 1, "ignored": 0})

    async def garbage(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "b", "leads": "all of them"})

    runners, urls = [], []
    for handler in (leader, older, garbage):
        app = web.Application()
        app.router.add_post("/peers/routes", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        urls.append(f"http://127.0.0.1:{s.getsockname()[1]}")
    sync = PeerSync(urls=urls, dns=None, metrics=Metrics())
    task = asyncio.ensure_future(sync.run())
    try:
        for _ in range(300):  # the sender tasks start with run's first round; the three that answer are replicas
            if len(sync._peers) == len(urls) and sum(p.verified for p in sync._peers.values()) == 3:
                break
            await asyncio.sleep(0.01)
        answers: dict[str, list[str]] = {}
        sync.claim(W, "doc A", lambda leaders: answers.setdefault("doc A", leaders))
        sync.claim(W, "doc B", lambda leaders: answers.setdefault("doc B", leaders))
        for _ in range(300):
            if len(answers) == 2:
                break
            await asyncio.sleep(0.01)
        assert answers == {"doc A": ["a"], "doc B": []}
        starts = [p for body in bodies for p in body.get("prefills", [])]  # type: ignore[attr-defined]
        assert [W, "doc A", False] in starts and [W, "doc B", False] in starts
        nobody = PeerSync(urls=[], dns=None, metrics=Metrics())
        nobody.claim(W, "doc C", lambda leaders: answers.setdefault("doc C", leaders))
        assert answers["doc C"] == []  # no peer: answered at once
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for runner in runners:
            await runner.cleanup()


async def test_a_peer_that_starts_listening_later_is_in_sync_within_a_first_contact_interval() -> None:
    """Replicas start one after the other: a replica's first heartbeat to a peer not listening yet fails.  It asks
    again every FIRST_CONTACT seconds (not a HEARTBEAT later), so both are in sync, and claim, about a tenth of a
    second after the peer listens; once it answered, heartbeats go every HEARTBEAT seconds."""
    import asyncio
    import socket
    import time

    from aiohttp import web
    from smg_router.coordination.transport import FIRST_CONTACT, HEARTBEAT

    beats: list[float] = []

    async def peer_routes(request: web.Request) -> web.Response:
        await request.read()
        beats.append(time.monotonic())
        sync.heard("127.0.0.1")  # the peer's own heartbeat reaches this router as it answers
        return web.json_response({"applied": 0, "ignored": 0, "id": "b", "leads": []})

    with socket.socket() as s:  # the peer's port, nobody listening on it yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sync = PeerSync(urls=[f"http://127.0.0.1:{port}"], dns=None, metrics=Metrics())
    task = asyncio.ensure_future(sync.run())
    app = web.Application()
    app.router.add_post("/peers/routes", peer_routes)
    runner = web.AppRunner(app)
    try:
        await asyncio.sleep(0.3)  # its first heartbeats failed
        assert not sync.in_sync()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        listening = time.monotonic()
        while not sync.in_sync():
            await asyncio.sleep(0.01)
            assert time.monotonic() - listening < HEARTBEAT / 2, "not in sync within half a heartbeat"
        assert time.monotonic() - listening < 3 * FIRST_CONTACT
        await asyncio.sleep(1.5 * HEARTBEAT)
        assert len(beats) == 2  # then the heartbeat's pace: one more
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()


def test_a_peer_queue_holds_its_bytes_at_most_and_drops_what_waited_too_long() -> None:
    """A peer that never answers: its queue keeps ``queue_bytes`` of routes at most (the oldest dropped, counted
    ``dropped``), and what waited longer than ``queue_seconds`` goes unsent (``expired``)."""
    import time

    metrics = Metrics()
    sync = PeerSync(urls=[], dns=None, metrics=metrics, queue_bytes=100_000, queue_seconds=0.2)
    peer = sync._peers["http://127.0.0.1:9"] = _Peer("http://127.0.0.1:9")
    for _ in range(100):
        sync.tell("regular", "m", W, "x" * 10_000, 0)
    assert 0 < peer.queued <= 100_000 and len(peer.pending) == 9
    sync.tell_prefill(W, "doc A", done=False)
    assert metrics.peer_records_sent.labels(peer.url, "dropped").value == 91
    time.sleep(0.25)
    sync._expire(peer)
    assert not peer.pending and not peer.prefills and peer.queued == 0
    assert metrics.peer_records_sent.labels(peer.url, "expired").value == 10


async def test_a_peer_that_leaves_takes_its_task_and_its_series_with_it() -> None:
    import asyncio

    metrics = Metrics()
    sync = PeerSync(urls=[], dns=None, metrics=metrics)
    peer = sync._peers["http://127.0.0.1:9"] = _Peer("http://127.0.0.1:9")
    peer.task = asyncio.ensure_future(asyncio.sleep(60))
    metrics.peer_records_sent.labels(peer.url, "sent").inc()
    metrics.peer_records_sent.labels(peer.url, "expired").inc()
    assert peer.url in metrics.exposition().decode()
    await sync._drop(sync._peers.pop(peer.url))
    assert peer.task.cancelled()
    assert peer.url not in metrics.exposition().decode()


def test_a_replica_is_not_in_sync_before_it_heard_from_each_peer() -> None:
    """Acknowledged is not enough: a peer that has not sent a batch yet may not know of this replica."""
    import time

    sync = PeerSync(urls=[], dns=None, metrics=Metrics())
    peer = sync._peers["http://127.0.0.3:9"] = _Peer("http://127.0.0.3:9", addresses=frozenset({"127.0.0.3"}))
    peer.acked_at = time.monotonic()
    assert not sync.in_sync()
    assert not sync.knows("127.0.0.4") and sync.knows("127.0.0.3") and sync.knows("::ffff:127.0.0.3")
    sync.heard("127.0.0.3")
    assert sync.in_sync()
