"""The reconcile loop and the finalizer without kopf or an API server: a fake ``Kube``, a fake ``DaemonStopped``,
and real router calls (to a closed port, for an unreachable replica)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import pytest
from smg_operator.desired import PodInfo, Replica
from smg_operator.metrics import OperatorMetrics
from smg_operator.reconciler import (
    DeregistrationPending,
    Interest,
    Runtime,
    clean_stale,
    finalize,
    keep_registered,
    recorded_replicas,
    retry_delay,
)
from smg_operator.routers import RouterClient
from smg_operator.settings import OperatorSettings
from support.operator_pods import closed_port, ready_pod

NS, NAME, UID = "ns", "llama", "uid-1"
SERVICE = {(NS, "smg-router"): [{"app": "router"}]}
SPEC = {
    "role": "regular",
    "model": "m",
    "selector": {"matchLabels": {"pool": "llama"}},
    "port": 8000,
    "drainTimeoutSeconds": 1,
    "router": {"service": "smg-router"},
}


class FakeKube:
    """Records every write; a status patch lands in ``body`` as kopf's live view of the object would show it."""

    def __init__(self, body: dict[str, Any] | None = None) -> None:
        self.body = body
        self.patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []

    def now_iso(self) -> str:
        return "2026-01-01T00:00:00Z"

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        self.patches.append(dict(status))
        if self.body is not None:
            self.body["status"] = {**(self.body.get("status") or {}), **status}
        return True

    async def post_event(self, *, namespace: str, name: str, uid: str, type: str, reason: str, message: str) -> None:
        self.events.append((type, reason, message))


class FakeStopped:
    """kopf's DaemonStopped as the loop uses it: false until set, and ``wait()`` for it."""

    def __init__(self) -> None:
        self._flag = asyncio.Event()

    def __bool__(self) -> bool:
        return self._flag.is_set()

    def wait(self) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self._flag.wait())

    def set(self) -> None:
        self._flag.set()


def router_pod(ip: str = "127.0.0.1", **changes: Any) -> PodInfo:
    """The one replica of the test's router Service (``changes``: any other field)."""
    return ready_pod(
        **{"namespace": NS, "name": "router-0", "labels": {"app": "router"}, "uid": "r0", "ip": ip, **changes}
    )


def runtime(session: aiohttp.ClientSession, kube: FakeKube, **settings: Any) -> Runtime:
    """Settings that allow the test's router Service (nothing is allowed by default)."""
    metrics = OperatorMetrics()
    settings.setdefault("allowed_router_services", frozenset(SERVICE))
    return Runtime(
        settings=OperatorSettings(**settings),
        metrics=metrics,
        kube=kube,
        routers=RouterClient(session=session, token=None, metrics=metrics, timeout=2.0),
    )


def reconciles(rt: Runtime, result: str) -> float:
    return rt.metrics.registry.get_sample_value("smg_operator_reconcile_total", {"result": result}) or 0.0


async def until(predicate: Callable[[], bool], *, what: str) -> None:
    """Poll ``predicate`` (a generous 30 s bound: a loaded machine is slow, the loop is not what is timed)."""
    try:
        async with asyncio.timeout(30):
            while not predicate():  # noqa: ASYNC110 - polls state the code under test keeps (a metric)
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


# -- the finalizer -------------------------------------------------------------------------------------
def test_the_finalizer_retry_delay_doubles_from_one_second_up_to_thirty() -> None:
    assert [retry_delay(r) for r in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]


async def test_the_finalizer_keeps_retrying_while_a_replica_is_unreachable_and_warns_on_the_first_and_every_tenth(
    session: aiohttp.ClientSession,
) -> None:
    kube = FakeKube()
    rt = runtime(session, kube, router_port=closed_port())
    rt.generations[(NS, NAME)] = 1
    delays = []
    for retry in range(12):
        with pytest.raises(DeregistrationPending, match="router unreachable; retrying: router-0: ") as pending:
            await finalize(
                rt,
                namespace=NS,
                name=NAME,
                uid=UID,
                spec=SPEC,
                status={},
                retry=retry,
                pods={NS: [router_pod()]},
                services=SERVICE,
            )
        delays.append(pending.value.delay)
    assert delays == [retry_delay(r) for r in range(12)]
    assert [(t, r) for t, r, _ in kube.events] == [("Warning", "RouterUnreachable")] * 2  # retries 0 and 10
    assert all(m.startswith("cannot deregister yet, retrying: router-0: ") for _, _, m in kube.events)
    assert len(kube.patches) == 12
    assert all(p["lastError"].startswith("deregistration pending: router-0: ") for p in kube.patches)
    assert rt.generations == {(NS, NAME): 1}  # not forgotten while it is pending


async def test_the_finalizer_forgets_the_smgworker_once_no_replica_holds_its_workers(
    session: aiohttp.ClientSession,
) -> None:
    kube = FakeKube()
    rt = runtime(session, kube)
    rt.generations[(NS, NAME)] = 1
    rt.metrics.registered.labels(f"{NS}/{NAME}").set(2)
    await finalize(rt, namespace=NS, name=NAME, uid=UID, spec=SPEC, status={}, retry=0, pods={}, services=SERVICE)
    assert rt.generations == {}
    assert (
        rt.metrics.registry.get_sample_value("smg_operator_registered_workers", {"smgworker": f"{NS}/{NAME}"}) is None
    )
    assert kube.patches == [] and kube.events == []


# -- the loop ------------------------------------------------------------------------------------------
def test_a_new_generation_pokes_the_loop_and_our_own_status_write_does_not(session: aiohttp.ClientSession) -> None:
    rt = runtime(session, FakeKube())
    poke = rt.pokes[(NS, NAME)] = asyncio.Event()
    rt.generation_seen((NS, NAME), 1)
    assert poke.is_set()
    poke.clear()
    rt.generation_seen((NS, NAME), 1)  # the event our status patch causes: same generation
    assert not poke.is_set()
    rt.generation_seen((NS, NAME), 2)
    assert poke.is_set()


async def test_the_loop_writes_an_unchanged_status_once_and_stops_when_the_daemon_is_stopped(
    session: aiohttp.ClientSession,
) -> None:
    body: dict[str, Any] = {"metadata": {"namespace": NS, "name": NAME, "uid": UID, "generation": 1}, "spec": SPEC}
    kube = FakeKube(body)
    rt = runtime(session, kube, reconcile_interval=0.01)
    stopped = FakeStopped()
    loop = asyncio.create_task(
        keep_registered(rt, namespace=NS, name=NAME, uid=UID, body=body, stopped=stopped, pods={}, services={}),
        name="test-reconcile-loop",
    )
    await until(lambda: reconciles(rt, "degraded") >= 5, what="five reconcile passes")
    assert (NS, NAME) in rt.pokes
    stopped.set()
    await asyncio.wait_for(loop, timeout=30)
    assert (NS, NAME) not in rt.pokes
    assert len(kube.patches) == 1  # the first pass wrote it; the same status again is not rewritten
    assert body["status"]["conditions"][2]["reason"] == "RouterServiceNotFound"
    assert [(t, r) for t, r, _ in kube.events] == [("Warning", "RouterServiceNotFound")]  # once, on the transition
    assert reconciles(rt, "error") == 0


async def test_the_loop_of_an_smgworker_being_deleted_ends_without_a_pass(session: aiohttp.ClientSession) -> None:
    body: dict[str, Any] = {
        "metadata": {
            "namespace": NS,
            "name": NAME,
            "uid": UID,
            "generation": 2,
            "deletionTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": SPEC,
    }
    kube = FakeKube(body)
    rt = runtime(session, kube)
    await asyncio.wait_for(
        keep_registered(rt, namespace=NS, name=NAME, uid=UID, body=body, stopped=FakeStopped(), pods={}, services={}),
        timeout=30,
    )
    assert rt.pokes == {} and kube.patches == [] and reconciles(rt, "degraded") == 0


# -- the finalizer and stale replicas ------------------------------------------------------------------
RECORDED = {
    "routers": [{"pod": "router-0", "url": "http://127.0.0.1:1", "namespace": NS}],
    "staleRouters": [{"pod": "old-router", "url": "http://127.0.0.2:1", "namespace": "other"}],
}


def test_recorded_replicas_are_read_from_routers_and_stale_routers_and_entries_without_a_namespace_are_skipped() -> (
    None
):
    status = {**RECORDED, "routers": [*RECORDED["routers"], {"pod": "legacy", "url": "http://127.0.0.3:1"}]}
    assert [(r.namespace, r.pod, r.url) for r in recorded_replicas(status)] == [
        (NS, "router-0", "http://127.0.0.1:1"),
        ("other", "old-router", "http://127.0.0.2:1"),
    ]


async def test_the_finalizer_keeps_the_smgworker_while_a_recorded_replica_runs_though_the_service_is_gone(
    session: aiohttp.ClientSession,
) -> None:
    """The router Service was deleted, but a replica that an earlier pass recorded still runs: it may hold our
    workers, so the finalizer must reach it (here it cannot: the port is closed) before letting go."""
    port = closed_port()
    status = {"routers": [{"pod": "router-0", "url": f"http://127.0.0.1:{port}", "namespace": NS}]}
    rt = runtime(session, FakeKube(), allowed_router_services=frozenset({(NS, "smg-router")}))
    with pytest.raises(DeregistrationPending, match="router-0"):
        await finalize(
            rt,
            namespace=NS,
            name=NAME,
            uid=UID,
            spec=SPEC,
            status=status,
            retry=0,
            pods={NS: [router_pod()]},
            services={},
        )


async def test_the_finalizer_lets_go_once_no_recorded_replica_runs_any_more(session: aiohttp.ClientSession) -> None:
    port = closed_port()
    status = {"routers": [{"pod": "router-0", "url": f"http://127.0.0.1:{port}", "namespace": NS}]}
    rt = runtime(session, FakeKube())
    gone = router_pod(terminating=True)
    await finalize(
        rt, namespace=NS, name=NAME, uid=UID, spec=SPEC, status=status, retry=0, pods={NS: [gone]}, services={}
    )
    await finalize(rt, namespace=NS, name=NAME, uid=UID, spec=SPEC, status=status, retry=0, pods={}, services={})


async def test_stale_replicas_are_cleaned_only_when_the_current_router_was_found(
    session: aiohttp.ClientSession,
) -> None:
    port = closed_port()
    old = Replica(pod="router-0", url=f"http://127.0.0.1:{port}", namespace=NS)
    rt = runtime(session, FakeKube())
    pods = [router_pod()]
    kept = await clean_stale(rt, recorded=[old], current=[], pods=pods, uid=UID, drain=1, clean=False)
    assert kept == [old] and rt.metrics.registry.get_sample_value(
        "smg_operator_hook_calls_total", {"hook": "list", "result": "unreachable"}
    ) in (None, 0.0)
    kept = await clean_stale(rt, recorded=[old], current=[], pods=pods, uid=UID, drain=1, clean=True)
    assert kept == [old]  # tried (unreachable), so still to clean
    assert (
        rt.metrics.registry.get_sample_value("smg_operator_hook_calls_total", {"hook": "list", "result": "unreachable"})
        == 1.0
    )
    assert await clean_stale(rt, recorded=[old], current=[old], pods=pods, uid=UID, drain=1, clean=True) == []
    assert await clean_stale(rt, recorded=[old], current=[], pods=[], uid=UID, drain=1, clean=True) == []


# -- scoped pokes --------------------------------------------------------------------------------------
def _interest(**changes: Any) -> Interest:
    fields: dict[str, Any] = {
        "namespace": NS,
        "selector": SPEC["selector"],
        "claimed": frozenset({"llama-0"}),
        "router": (NS, "smg-router"),
        "router_selector": {"app": "router"},
        "router_pods": frozenset({(NS, "router-0"), ("other", "old-router")}),
    }
    return Interest(**{**fields, **changes})


@pytest.mark.parametrize(
    ("pod", "wakes"),
    [
        ({"name": "llama-9", "labels": {"pool": "llama"}}, True),  # the selector matches a new pod
        ({"name": "llama-0", "labels": {"pool": "other"}}, True),  # relabelled away from us: its old owner
        ({"name": "x", "labels": {"pool": "other"}}, False),  # someone else's pod
        ({"name": "x", "labels": {"pool": "llama"}, "namespace": "team-b"}, False),  # same labels, other namespace
        ({"name": "router-7", "labels": {"app": "router"}}, True),  # a new replica of our router
        ({"name": "old-router", "labels": {}, "namespace": "other"}, True),  # a stale replica
        ({"name": "router-7", "labels": {"app": "router"}, "namespace": "team-b"}, False),
    ],
)
def test_a_pod_event_pokes_only_the_smgworkers_it_concerns(
    session: aiohttp.ClientSession, pod: dict[str, Any], wakes: bool
) -> None:
    rt = runtime(session, FakeKube())
    mine, theirs = (NS, NAME), ("team-b", "other")
    rt.pokes[mine], rt.pokes[theirs] = asyncio.Event(), asyncio.Event()
    rt.interests[mine] = _interest()
    rt.interests[theirs] = _interest(
        namespace="team-b",
        selector={"matchLabels": {"pool": "nope"}},
        claimed=frozenset(),
        router=None,
        router_pods=frozenset(),
    )
    rt.poke_pod(router_pod(**pod))
    assert rt.pokes[mine].is_set() is wakes
    assert not rt.pokes[theirs].is_set()


def test_a_loop_before_its_first_pass_is_poked_by_every_event(session: aiohttp.ClientSession) -> None:
    rt = runtime(session, FakeKube())
    rt.pokes[(NS, NAME)] = asyncio.Event()
    rt.poke_pod(router_pod(name="anything", labels={}))
    assert rt.pokes[(NS, NAME)].is_set()


def test_a_service_event_pokes_only_the_smgworkers_routed_through_it(session: aiohttp.ClientSession) -> None:
    rt = runtime(session, FakeKube())
    rt.pokes[(NS, NAME)] = asyncio.Event()
    rt.interests[(NS, NAME)] = _interest()
    rt.poke_service(NS, "unrelated")
    assert not rt.pokes[(NS, NAME)].is_set()
    rt.poke_service(NS, "smg-router")
    assert rt.pokes[(NS, NAME)].is_set()


async def test_a_stale_replica_that_cannot_be_cleaned_yet_does_not_make_every_pass_a_status_write(
    session: aiohttp.ClientSession,
) -> None:
    port = closed_port()
    old = {"pod": "old-router", "url": f"http://127.0.0.3:{port}", "namespace": NS}
    body: dict[str, Any] = {
        "metadata": {"namespace": NS, "name": NAME, "uid": UID, "generation": 1},
        "spec": SPEC,
        "status": {"routers": [old]},
    }
    kube = FakeKube(body)
    rt = runtime(
        session,
        kube,
        reconcile_interval=0.01,
        router_port=port,
        allowed_router_services=frozenset({(NS, "smg-router")}),
    )
    pods = {NS: [router_pod(), router_pod("127.0.0.3", name="old-router", labels={})]}
    stopped = FakeStopped()
    loop = asyncio.create_task(
        keep_registered(rt, namespace=NS, name=NAME, uid=UID, body=body, stopped=stopped, pods=pods, services=SERVICE),
        name="test-reconcile-loop",
    )
    await until(lambda: reconciles(rt, "degraded") >= 5, what="five reconcile passes")
    stopped.set()
    await asyncio.wait_for(loop, timeout=30)
    assert body["status"]["staleRouters"] == [old]  # tried every pass (unreachable), kept for the next
    assert len(kube.patches) == 1, kube.patches
