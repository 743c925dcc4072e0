"""RouterCore: the router's parts wired together once, and their background tasks.

Built by ``app.running``; every request (``Request``) carries it, and handlers reach everything through it.
The background tasks (health checks, load polling, tree eviction) are named, start with the app and are
cancelled and awaited when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from smg_router import wire
from smg_router.coordination import NO_PEERS, Holds, Peers, PeerSync, Receiver
from smg_router.fleet.fleet import Fleet
from smg_router.metrics import Metrics
from smg_router.policies.factory import PolicyFactory
from smg_router.policies.index import EventIndexes
from smg_router.policies.registry import PolicyRegistry
from smg_router.prompts import Tokenizer, TokenizerError
from smg_router.proxy import Proxy
from smg_router.request import FORWARD_REQUEST_HEADERS, Admission
from smg_router.settings import Settings
from smg_router.tree import share_budget
from smg_router.upstream import ResponseLimits, Timeouts, Upstream
from smg_router.workers.demand import ModelDemand, demand_rows
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import WorkerSpec, WorkerStatus, normalize_url

log = logging.getLogger(__name__)
LOOP_LAG_INTERVAL = 0.25
TREE_CHECK_INTERVAL = 0.5
"""Seconds between two rounds of tree upkeep (reclaim, high-water caps, the byte budget): what a burst may
add over the budget is what the requests of half a second insert."""


class RouterCore:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.loads = LoadView(max_age=settings.load.max_age)
        self.registry = WorkerRegistry()
        p = settings.peers
        self.peers: PeerSync | None = None
        """The other replicas, told every cache-aware route (``--peer``, ``--peers-dns``); None: no peers."""
        if p.enabled:
            self.peers = PeerSync(
                urls=p.urls,
                dns=p.dns,
                metrics=self.metrics,
                secret=p.secret,
                queue_bytes=p.queue_bytes,
                queue_seconds=p.queue_seconds,
                batch_bytes=min(p.batch_bytes, settings.server.max_payload_size),
                bind=source_address(settings.server.host),
            )
            if p.secret is None:
                log.warning("peers without --peer-secret: batches are taken from the peers' addresses unsigned")
        told: Peers = self.peers if self.peers is not None else NO_PEERS
        self.tokenizers = load_tokenizers(settings.routing.tokenizers)
        self.events = EventIndexes(
            budget_bytes=settings.policy.tree_memory_budget,
            chars_per_token=settings.policy.tree_chars_per_token or 1.0,
            tokenized=frozenset(self.tokenizers),
            spec_seconds=settings.policy.prefill_hold_seconds,  # as long as a burst may wait for its first prefill
        )
        """The workers matched by their engines' KV events, and what those say (``policies.index``)."""
        self.metrics.add_kv_index_sources(self._kv_index_bytes, self._kv_index_blocks)
        factory = PolicyFactory(settings=settings.policy, loads=self.loads, metrics=self.metrics, events=self.events)
        self.policies = PolicyRegistry(factory, settings.policy)
        self.metrics.add_tree_size_source(self.policies.tree_sizes)
        self.metrics.add_tree_bytes_source(self.policies.tree_bytes)
        self.metrics.add_demand_source(self._demand)
        self.fleet = Fleet(
            settings=settings,
            registry=self.registry,
            policies=self.policies,
            loads=self.loads,
            metrics=self.metrics,
            events=self.events,
        )
        self.upstream = Upstream(
            Timeouts(
                connect=settings.server.connect_timeout,
                total=settings.server.request_timeout,
                first_byte=settings.server.first_byte_timeout,
                stream_idle=settings.server.stream_idle_timeout,
            ),
            ResponseLimits(
                head=settings.server.max_response_header_size,
                body=settings.server.max_response_size,
                refused=lambda reason: self.metrics.upstream_refused.labels(reason).inc(),
            ),
            on_resend=self._count_resend,
        )
        self.fleet.lifecycle.on_removed = self.upstream.forget
        server = settings.server
        self.budget = wire.Budget(server.max_inflight_bytes)
        """Request body bytes the server holds, counted as they arrive (``--max-inflight-bytes``)."""
        self.admission = Admission(
            max_requests=server.max_concurrent_requests,
            budget=self.budget,
            max_body=server.max_payload_size,
            metrics=self.metrics,
        )
        self.proxy = Proxy(
            registry=self.registry,
            policies=self.policies,
            upstream=self.upstream,
            metrics=self.metrics,
            retry=settings.retry,
            pd_mode=settings.pd.mode if settings.pd.enabled else None,
            by_load=self.policies.by_load,  # the non-generative endpoints' choice
            routing=settings.routing,  # session key header, model aliases
            peers=told,  # told every cache-aware route
            tokenizers=self.tokenizers,  # the prompts whose token ids KV events are matched on
            chars_per_token=settings.policy.tree_chars_per_token,  # prompts counted in tokens (demand metrics)
            holds=Holds(  # a burst on a new prefix waits for its first prefill
                seconds=settings.policy.prefill_hold_seconds,
                metrics=self.metrics,
                peers=told,  # ... the peers are told of it, so theirs wait too
                claim_seconds=settings.policy.prefill_claim_seconds,  # ... led by one replica, not one each
                claim_min_chars=settings.policy.prefill_claim_min_chars,
                loads=self.loads,  # ... and takes turns on a slot engine
            ),
            hold=settings.hold,  # a request for a model with no routable worker waits for one (scale from zero)
        )
        self.fleet.lifecycle.on_change = self.proxy.waiting.wake
        self.receiver = Receiver(
            peers=self.peers,
            registry=self.registry,
            policies=self.policies,
            holds=self.proxy.holds,
            metrics=self.metrics,
        )
        """The peers' batches (``POST /peers/routes``): who may send, what of it is applied."""
        self._tasks: list[asyncio.Task[None]] = []
        self.forward_headers = tuple(
            h for h in FORWARD_REQUEST_HEADERS if not (h == "authorization" and settings.server.api_key)
        )
        """The client headers forwarded to workers: never the router's own API key."""
        self.shutting_down = False
        """Set on SIGTERM: readiness answers 503 while the router serves on (``__main__.serve``)."""
        self.peers_grace_until = time.monotonic() + settings.peers.ready_grace
        """Until then readiness waits for the peers to be in sync (``PeerSettings.ready_grace``)."""

    def _count_resend(self, url: str) -> None:
        """A request the upstream client sent again on a fresh connection: ``smg_retries_total{outcome=resent}``,
        by the endpoint it went to (a worker URL has no path: the rest is the endpoint's)."""
        self.metrics.retries.labels(urlsplit(url).path, "resent").inc()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready with a routable worker; in PD mode with a routable prefill AND a routable decode worker; with
        ``--hold-when-empty`` without one too (a request for a model at zero waits here for its worker).  With peers,
        not before they are in sync (every one answered), for at most ``peers.ready_grace`` seconds after the start:
        a replica's first requests claim their prefills as the others' do (a request that would not, sent with
        another replica's on the same new prompt, makes the worker prefill it twice)."""
        panics = self.settings.retry.max_ejection_share < 1.0  # open breakers never take out every ready worker
        routable = [w for w in self.registry if w.routable or (panics and w.status is WorkerStatus.READY)]
        detail: dict[str, Any] = {"workers": len(self.registry), "routable": len(routable)}
        if self.shutting_down:
            return False, {"status": "shutting_down", **detail}
        peers = self.peers
        if (
            peers is not None
            and not peers.alone()
            and not peers.in_sync()
            and time.monotonic() < self.peers_grace_until
        ):
            return False, {"status": "peers_not_in_sync", **detail}
        holding = self.settings.hold.seconds > 0  # it holds what it cannot route: out of its Service it would get none
        if not self.settings.pd.enabled:
            return bool(routable) or holding, detail
        by_role = {role: sum(w.role == role for w in routable) for role in ("prefill", "decode")}
        return all(by_role.values()) or holding, {**detail, **{f"routable_{r}": n for r, n in by_role.items()}}

    def _demand(self) -> Iterator[tuple[str, str, ModelDemand]]:
        return demand_rows(self.registry, self.loads, now=time.monotonic())

    def _kv_index_bytes(self) -> list[tuple[str, int]]:
        return [(model, blocks.estimated_bytes()) for model, blocks in self.events.models().items()]

    def _kv_index_blocks(self) -> list[tuple[str, str, int]]:
        return [
            (model, worker, blocks.blocks_of(worker))
            for model, blocks in self.events.models().items()
            for worker in blocks.workers()
        ]

    async def start(self) -> None:
        await self.upstream.start()
        await self.fleet.start()
        model = self.settings.model_id
        events = {url: (endpoint, replay) for url, endpoint, replay in self.settings.routing.kv_events}
        specs: list[dict[str, object]] = [{"url": url, "model_id": model} for url in self.settings.worker_urls]
        specs += [
            {"url": url, "role": "prefill", "model_id": model, "bootstrap_port": port}
            for url, port in self.settings.pd.prefill
        ]
        specs += [{"url": url, "role": "decode", "model_id": model} for url in self.settings.pd.decode]
        for spec in specs:  # the health checker's first round probes them
            where = events.get(normalize_url(spec["url"]))
            if where is not None:
                spec["kv_events"] = {"endpoint": where[0], "replay_endpoint": where[1]}
            await self.fleet.register(WorkerSpec.from_json(spec), probe=False)
        self._spawn("smg-health-checker", self.fleet.health.run())
        self._spawn("smg-load-monitor", self.fleet.load_monitor.run())
        self._spawn("smg-tree-eviction", self._evict_periodically())
        self._spawn("smg-loop-lag", self._measure_loop_lag())
        if self.peers is not None:
            self._spawn("smg-peer-sync", self.peers.run())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.upstream.close()
        await self.fleet.close()

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    async def _measure_loop_lag(self) -> None:
        """Every LOOP_LAG_INTERVAL, how much later than asked a timer fired (``smg_event_loop_lag_seconds``)."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(LOOP_LAG_INTERVAL)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - t0 - LOOP_LAG_INTERVAL))

    async def _evict_periodically(self) -> None:
        """Tree upkeep: a round every TREE_CHECK_INTERVAL, run in slices of a few ms with a turn of the event loop
        between two (no request waits behind a big job)."""
        while True:
            await asyncio.sleep(TREE_CHECK_INTERVAL)
            self.share_memory()
            await run_tree_upkeep(self.policies)

    def share_memory(self) -> None:
        """The trees and the indexes of the engines' KV events share ``--tree-memory-budget``
        (``tree.share_budget``): each may grow into the room the others leave; past it, each is cut in proportion."""
        trees = sum(n for *_, n in self.policies.tree_bytes())
        indexes = list(self.events.models().values())
        held = [trees, *(index.estimated_bytes() for index in indexes)]
        tree_budget, *index_budgets = share_budget(self.settings.policy.tree_memory_budget, held)
        self.policies.tree_budget = tree_budget
        for index, n in zip(indexes, index_budgets, strict=True):
            index.fit(n)


async def run_tree_upkeep(policies: PolicyRegistry) -> None:
    """One round of upkeep of every tree, with turns of the event loop between two of its slices.

    Three turns, in fact: after the first, this task is at the head of the loop's ready queue, ahead of the
    timers and I/O callbacks that fell due during the slice; the second runs those callbacks behind it, and
    what they wake (a task waiting on a sleep, a read, a lock: a future they resolve) is scheduled only
    then, one more turn away; the third lets that task run before the next slice. So what waited waits for
    one slice (~2 ms), not two (measured with two turns: a sleeping task woke every second slice).
    """
    for _ in policies.tree_upkeep():
        for _turn in range(3):
            await asyncio.sleep(0)


class Request(wire.Request):
    """A request as the router's handlers see it: the server's, plus the core and the route's path parameters, both
    set by ``app.Dispatcher`` before any handler runs (no constructor of its own: the server makes one per request,
    and a second layer of keyword arguments cost more than its parsing)."""

    __slots__ = ("core", "params")

    core: RouterCore
    params: dict[str, str]


Handler = Callable[[Request], Awaitable[wire.Response]]


def source_address(host: str) -> str | None:
    """The address the batches to the peers leave from: ``--host`` when it names one IP address (the peers know this
    router by it), else the system's choice (a pod's one address)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return None if ip.is_unspecified else str(ip)


def load_tokenizers(paths: Sequence[tuple[str, str]]) -> dict[str, Tokenizer]:
    """Each ``--tokenizer MODEL=PATH``, loaded; a router that cannot load one does not start (SystemExit naming it)."""
    loaded = {}
    for model, path in paths:
        try:
            loaded[model] = Tokenizer(Path(path))
        except TokenizerError as e:
            raise SystemExit(f"--tokenizer {model}={path}: {e}") from None
        log.info("model %s: prompts tokenized with %s", model, path)
    return loaded
