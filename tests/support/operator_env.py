"""A namespace on the real API server with router replicas and worker pods backed by real processes.

Router replicas are Pod objects selected by a Service, each backed by a real ``smg-router`` on its own loopback
address and the Service's port; workers are Pod objects backed by ``smg-sim`` processes on their own addresses.
"""

from __future__ import annotations

import contextlib
import json
import socket
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.kube import ControlPlane
from support.operator_proc import OperatorProcess
from support.procs import MODEL, Router, Sim, free_port, next_host, start_router, start_sim

KEY = "op-test-key"
ROOT = Path(__file__).resolve().parents[2]


def new_env(cp: ControlPlane, logs: Path, ns: str, *, replicas: int = 2) -> Env:
    """A namespace (created if missing) with the CRD installed and ports chosen for ``replicas`` router pods."""
    cp.apply_yaml(ROOT / "crds/smgworker.yaml")
    cp.wait_crd_established("smgworkers.smg.dev")
    if cp.request("GET", f"/api/v1/namespaces/{ns}")[0] == 404:
        cp.create_namespace(ns)
    hosts = [next_host() for _ in range(replicas)]
    e = Env(cp=cp, ns=ns, logs=logs, router_port=port_free_on(hosts), worker_port=free_port())
    e.router_hosts = {f"router-{i}": h for i, h in enumerate(hosts)}
    return e


def routed_env(
    cp: ControlPlane, logs: Path, prefix: str, *, replicas: int = 2, router_args: list[str] | None = None
) -> Env:
    """A fresh namespace ``prefix-<random>`` whose Service smg-router selects ``replicas`` running router pods
    (router-0, router-1, ...), each an smg-router with ``router_args``."""
    e = new_env(cp, logs, f"{prefix}-{uuid.uuid4().hex[:6]}", replicas=replicas)
    e.add_service("smg-router", "smg-router")
    for i in range(replicas):
        e.add_router_pod(f"router-{i}", args=router_args)
    return e


@contextlib.contextmanager
def operated_env(
    cp: ControlPlane,
    logs: Path,
    prefix: str,
    *,
    routers: Sequence[str],
    interval: float = 2,
    router_args: list[str] | None = None,
) -> Iterator[Env]:
    """``routed_env`` with two replicas and an operator allowed the router Services ``routers`` of it; the
    operator, then every router and worker, stopped when the block ends."""
    e = routed_env(cp, logs, prefix, router_args=router_args)
    try:
        e.operator = e.new_operator(*allow_routers(e.ns, *routers), interval=interval).start()
        yield e
    finally:
        e.stop()


def allow_routers(ns: str, *services: str) -> list[str]:
    """smg-operator flags allowing these router Services of ``ns``: by default it calls only its own router
    (--router-service in --router-namespace), never a Service an SMGWorker's author picked (docs/operator.md)."""
    return [arg for service in services for arg in ("--allowed-router-service", f"{ns}/{service}")]


def leading_own_router(ns: str) -> list[str]:
    """smg-operator flags of an operator as the chart runs it in ``ns``: its own router smg-router there (the only
    one allowed) and leader election through a Lease there."""
    return [
        *("--router-service", "smg-router", "--router-namespace", ns),
        *("--leader-election", "--leader-election-namespace", ns),
    ]


LOOPBACK = "127.0.0.0/8"
"""Every process of this tier listens on a loopback address, which a static endpoint may name only when listed:
``--allowed-endpoint LOOPBACK``."""


def port_free_on(hosts: list[str]) -> int:
    """One port free on every host (router replicas share the Service's port, each on its own pod IP)."""
    while True:
        port = free_port(hosts[0])
        if all(_bindable(h, port) for h in hosts[1:]):
            return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Env:
    """One test namespace and the processes behind its pods."""

    cp: ControlPlane
    ns: str
    logs: Path
    router_port: int
    worker_port: int
    routers: dict[str, Router] = field(default_factory=dict)
    router_hosts: dict[str, str] = field(default_factory=dict)
    sims: dict[str, Sim] = field(default_factory=dict)
    operator: OperatorProcess | None = None
    """The operator serving this namespace, once started."""

    def operator_args(self, interval: float) -> list[str]:
        """The flags of any operator on this namespace: the namespace, its reconcile interval, the routers' port."""
        return ["--namespace", self.ns, "--reconcile-interval", str(interval), "--router-port", str(self.router_port)]

    def new_operator(self, *extra: str, interval: float, **kw: Any) -> OperatorProcess:
        """An operator (not started) on this namespace with ``extra`` flags, logging beside the env's processes."""
        assert self.cp.kubeconfig is not None, "the control plane is not running"
        return OperatorProcess(
            self.logs, self.cp.kubeconfig, admin_key=KEY, args=[*self.operator_args(interval), *extra], **kw
        )

    def stop(self) -> None:
        """The operator first (it would call stopped routers otherwise), then every router and worker process."""
        if self.operator is not None:
            self.operator.stop()
        for proc in [*self.routers.values(), *self.sims.values()]:
            proc.stop()

    def start_router(self, pod: str, *, args: list[str] | None = None) -> Router:
        host = self.router_hosts.setdefault(pod, next_host())
        self.routers[pod] = start_router(self.logs, host=host, port=self.router_port, admin_key=KEY, args=args)
        return self.routers[pod]

    def add_service(self, name: str, app: str) -> None:
        self.cp.api(
            "POST",
            f"/api/v1/namespaces/{self.ns}/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name},
                "spec": {"selector": {"app": app}, "ports": [{"port": self.router_port}]},
            },
        )

    def add_router_pod(self, pod: str, app: str = "smg-router", args: list[str] | None = None) -> Router:
        router = self.start_router(pod, args=args)
        self.cp.make_ready_pod(self.ns, pod, {"app": app}, router.host)
        return router

    def add_worker_pod(
        self,
        pod: str,
        labels: dict[str, str],
        *,
        extra: list[str] | None = None,
        annotations: dict[str, str] | None = None,
        host: str | None = None,
    ) -> Sim:
        sim = start_sim(self.logs, host=host or next_host(), port=self.worker_port, extra=extra)
        self.sims[pod] = sim
        self.cp.make_ready_pod(self.ns, pod, labels, sim.host, annotations=annotations, finalizers=["smg.test/hold"])
        return sim

    def urls(self, pod: str) -> set[str]:
        return {w["url"] for w in self.routers[pod].workers()}

    def smgw(self, name: str) -> dict | None:
        status, body = self.cp.request("GET", f"/apis/smg.dev/v1alpha1/namespaces/{self.ns}/smgworkers/{name}")
        return body if status == 200 else None

    def condition(self, name: str, ctype: str) -> dict:
        obj = self.smgw(name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})

    def event_reasons(self, name: str) -> list[str]:
        events = self.cp.api("GET", f"/api/v1/namespaces/{self.ns}/events")["items"]
        return [e["reason"] for e in events if e["involvedObject"].get("name") == name]


def pool(
    name: str,
    labels: dict[str, str],
    *,
    port: int,
    router_port: int,
    role: str = "regular",
    service: str = "smg-router",
    **extra: object,
) -> str:
    spec = {
        "role": role,
        "model": MODEL,
        "selector": {"matchLabels": labels},
        "port": port,
        "router": {"service": service, "port": router_port},
        **extra,
    }
    return json.dumps({"apiVersion": "smg.dev/v1alpha1", "kind": "SMGWorker", "metadata": {"name": name}, "spec": spec})
