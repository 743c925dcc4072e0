"""Multi-tenant safety and "Ready means ready" against a real kube-apiserver.

The operator runs as in the chart: its default router is ``--router-service smg-router`` in ``--router-namespace``
(the "system" namespace), and no ``--allowed-router-service`` is given, so that router is the only one allowed.
A tenant namespace holds the tenant's own Service ``my-router``, backed by a real ``smg-router`` started without an
admin token (a tenant's router takes anything), behind a recording proxy on the pod's IP: what the proxy saw is
everything the operator sent there.  Static endpoints may name loopback only (``--allowed-endpoint 127.0.0.0/8``,
where this tier's processes listen): the link-local metadata address is still refused.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from support.kube import ControlPlane
from support.operator_env import LOOPBACK, Env, new_env, routed_env
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import MODEL, Router, Sim, free_port, http_json, next_host, start_router, start_sim, wait_until
from support.recording_proxy import RecordingProxy

INTERVAL = 1.0
METADATA = "http://169.254.169.254:80"


@dataclass
class World:
    cp: ControlPlane
    system: Env
    """The operator's own namespace, with its router Service smg-router and one replica."""
    tenant: Env
    """A team's namespace: its worker pod, its SMGWorkers, and its own Service my-router."""
    tenant_router: Router
    proxy: RecordingProxy
    operator: OperatorProcess
    outside: Sim
    """A worker with no pod: a static endpoint."""

    def spec(self, **extra: object) -> dict[str, object]:
        return {"role": "regular", "model": MODEL, "port": self.tenant.worker_port, "drainTimeoutSeconds": 1, **extra}

    def allowed_router(self) -> dict[str, object]:
        return {"service": "smg-router", "namespace": self.system.ns, "port": self.system.router_port}

    def apply(self, name: str, spec: dict[str, object]) -> str:
        doc = {"apiVersion": "smg.dev/v1alpha1", "kind": "SMGWorker", "metadata": {"name": name}, "spec": spec}
        self.cp.apply_yaml(json.dumps(doc), self.tenant.ns)  # kubectl: its discovery cache learns the CRD
        return str((self.tenant.smgw(name) or {})["metadata"]["uid"])

    def patch_spec(self, name: str, spec: dict[str, object]) -> None:
        self.cp.api(
            "PATCH",
            f"/apis/smg.dev/v1alpha1/namespaces/{self.tenant.ns}/smgworkers/{name}",
            {"spec": spec},
            content_type="application/merge-patch+json",
        )

    def ready(self, name: str) -> tuple[str | None, str | None, str]:
        c = self.tenant.condition(name, "Ready")
        return c.get("status"), c.get("reason"), c.get("message", "")

    def wait_ready_reason(self, name: str, reason: str) -> dict[str, str]:
        try:
            wait_until(lambda: self.ready(name)[1] == reason, timeout=SETTLE, what=f"{name}: Ready reason {reason}")
        except AssertionError as err:
            raise AssertionError(f"{err}; status: {(self.tenant.smgw(name) or {}).get('status')}") from None
        return self.tenant.condition(name, "Ready")

    def owned(self, uid: str) -> list[str]:
        """URLs the system router holds for the SMGWorker ``uid``."""
        return [
            w["url"]
            for w in self.system.routers["router-0"].workers()
            if (w.get("labels") or {}).get("smg.dev/smgworker-uid") == uid
        ]

    def more_passes(self) -> None:
        """Wait until every SMGWorker here has had about three more reconcile passes (the operator's metric counts
        them all together), so a call that was going to be made would have been."""
        count = len(self.cp.api("GET", f"/apis/smg.dev/v1alpha1/namespaces/{self.tenant.ns}/smgworkers")["items"])
        start = self.operator.reconcile_passes()
        wait_until(
            lambda: self.operator.reconcile_passes() >= start + 3 * count, timeout=SETTLE, what="more reconcile passes"
        )

    def status_column(self, name: str) -> str:
        """The STATUS printer column of ``kubectl get smgw``."""
        lines = self.cp.kubectl("get", "smgw", name, "-n", self.tenant.ns).stdout.splitlines()
        header, row = lines[0].split(), lines[1].split()
        return row[header.index("STATUS")]


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cp = control_plane
    logs = tmp_path_factory.mktemp("tenancy")
    system = routed_env(cp, logs, "smg-system", replicas=1)
    tenant = new_env(cp, logs, f"team-{uuid.uuid4().hex[:6]}", replicas=1)
    tenant.add_service("my-router", "my-router")
    behind = next_host()
    tenant_router = start_router(logs, host=behind, port=free_port(behind))  # no admin key: takes anything
    proxy_host = tenant.router_hosts["router-0"]
    proxy = RecordingProxy(proxy_host, tenant.router_port, (tenant_router.host, tenant_router.port)).start()
    cp.make_ready_pod(tenant.ns, "my-router-0", {"app": "my-router"}, proxy_host)
    outside = start_sim(logs)
    op = system.new_operator(
        *("--namespace", tenant.ns, "--router-service", "smg-router", "--router-namespace", system.ns),
        *("--allowed-endpoint", LOOPBACK),
        interval=INTERVAL,
    ).start()
    w = World(
        cp=cp,
        system=system,
        tenant=tenant,
        tenant_router=tenant_router,
        proxy=proxy,
        operator=op,
        outside=outside,
    )
    yield w
    op.stop()
    proxy.stop()
    for proc in [*system.routers.values(), *tenant.sims.values(), tenant_router, outside]:
        proc.stop()


def test_an_smgworker_pointing_at_its_own_router_service_is_refused_and_nothing_is_sent_there(world: World) -> None:
    w = world
    sim = w.tenant.add_worker_pod("w-0", {"app": "w"})
    mine = {"service": "my-router", "namespace": w.tenant.ns, "port": w.tenant.router_port}  # the tenant's own
    uid = w.apply("deputy", w.spec(selector={"matchLabels": {"app": "w"}}, router=mine))

    ready = w.wait_ready_reason("deputy", "RouterNotAllowed")
    assert ready["status"] == "False" and f"{w.tenant.ns}/my-router" in ready["message"], ready
    assert w.tenant.condition("deputy", "Registered")["reason"] == "RouterNotAllowed"
    wait_until(
        lambda: "RouterNotAllowed" in w.tenant.event_reasons("deputy"), timeout=SETTLE, what="a RouterNotAllowed Event"
    )
    events = w.cp.api("GET", f"/api/v1/namespaces/{w.tenant.ns}/events")["items"]
    assert any(e["reason"] == "RouterNotAllowed" and e["type"] == "Warning" for e in events)
    assert w.status_column("deputy") == "RouterNotAllowed"
    # two more passes of the operator's own clock, and still: not one byte reached the tenant's router pod, so
    # neither a registration nor the admin token; its registry is empty, and so is the allowed router's
    w.more_passes()
    assert w.proxy.connections == 0, w.proxy.requests()
    assert w.tenant_router.workers() == []
    assert w.owned(uid) == []

    # fixed: the same SMGWorker names the operator's router, and is registered there and Ready
    w.patch_spec("deputy", {"router": w.allowed_router()})
    w.wait_ready_reason("deputy", "Ready")
    assert w.owned(uid) == [sim.url]
    assert w.status_column("deputy") == "Ready"
    assert w.proxy.connections == 0 and w.tenant_router.workers() == []

    # the recorder does see what is sent through it (so zero above is a measurement, not a blind spot)
    assert http_json("GET", w.proxy.url + "/workers", headers={"Authorization": "Bearer probe"})[0] == 200
    assert [(r.method, r.path, r.headers.get("authorization")) for r in w.proxy.requests()] == [
        ("GET", "/workers", "Bearer probe")
    ]


def test_a_link_local_static_endpoint_is_refused_with_nothing_registered_until_fixed(world: World) -> None:
    w = world
    allowed = w.outside.url  # on 127.0.0.x: listed (--allowed-endpoint 127.0.0.0/8)
    uid = w.apply("meta", w.spec(endpoints=[allowed, METADATA], router=w.allowed_router()))

    ready = w.wait_ready_reason("meta", "EndpointNotAllowed")
    assert ready["status"] == "False" and METADATA in ready["message"] and allowed not in ready["message"], ready
    resolved = w.tenant.condition("meta", "EndpointsResolved")
    assert (resolved["status"], resolved["reason"]) == ("False", "EndpointNotAllowed")
    wait_until(
        lambda: "EndpointNotAllowed" in w.tenant.event_reasons("meta"),
        timeout=SETTLE,
        what="an EndpointNotAllowed Event",
    )
    assert w.status_column("meta") == "EndpointNotAllowed"
    w.more_passes()
    # nothing registered: not the metadata address, and not the allowed endpoint either (no partial apply)
    assert w.owned(uid) == []
    assert not any(x["url"].startswith("http://169.254.") for x in w.system.routers["router-0"].workers())

    w.patch_spec("meta", {"endpoints": [allowed]})
    w.wait_ready_reason("meta", "Ready")
    assert w.owned(uid) == [allowed]
    assert (w.tenant.smgw("meta") or {})["status"]["ready"] == "1/1"


def test_ready_says_why_not_when_no_router_replica_answers(world: World) -> None:
    w = world
    own = w.tenant.sims["lonely"] = start_sim(w.tenant.logs)  # its own worker: a URL another SMGWorker holds conflicts
    uid = w.apply("lonely", w.spec(endpoints=[own.url], router=w.allowed_router()))
    w.wait_ready_reason("lonely", "Ready")
    assert w.owned(uid) == [own.url]
    w.system.routers["router-0"].stop()
    try:
        ready = w.wait_ready_reason("lonely", "NoRouterReachable")
        assert ready["status"] == "False" and "router-0" in ready["message"], ready
        assert w.status_column("lonely") == "NoRouterReachable"
    finally:
        w.system.start_router("router-0")  # same address and port, an empty registry
    w.wait_ready_reason("lonely", "Ready")
    assert w.owned(uid) == [own.url]
