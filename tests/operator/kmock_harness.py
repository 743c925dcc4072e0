"""The emulated-API operator tier's world: a Kubernetes emulator, an ``smg-operator`` subprocess, and real
``smg-router`` and ``smg-sim`` processes standing in for the pods the emulator lists.

The tests play the kubelet: they create Pod objects and patch their status (Running, Ready, a loopback
``podIP``) through the emulator's HTTP API, so the operator sees the same watch events a cluster would send.
Every "pod" is a real process on its own loopback address: router replicas share one port (as pods of a
Deployment share ``router.port``) and workers share another (``spec.port``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from support.kmock_emulator import EmulatorServer
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import MODEL, Router, Sim, free_port, http_json, next_host, start_router, start_sim, wait_until

NAMESPACE = "smg-test"
ROUTER_SERVICE = "smg-router"
ROUTER_LABELS = {"app": "smg-router"}
ADMIN_KEY = "kmock-tier-admin-key"
HOLD_FINALIZER = "smg.test/hold"
"""Keeps a deleted pod around as "terminating", as a kubelet would during the grace period."""
OPERATOR_FINALIZER = "smg.dev/finalizer"
OWNER_UID = "smg.dev/smgworker-uid"
POD_UID = "smg.dev/pod-uid"
RECONCILE_INTERVAL = 1.0
LOOPBACK = "127.0.0.0/8"
"""Where every process of this tier listens (one loopback address per pod)."""
ROUTER_TIMEOUT = 1.0


class ApiError(AssertionError):
    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        self.status = status
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path} -> {status}: {message}")


class Kube:
    """A tiny synchronous client of the emulator's REST API, with the object shapes these tests need."""

    def __init__(self, server: EmulatorServer, namespace: str = NAMESPACE) -> None:
        self.server = server
        self.ns = namespace

    # -- REST --------------------------------------------------------------------------------------
    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        ok: Iterable[int] = (200, 201),
    ) -> Any:
        status, data = http_json(
            method, self.server.url + path, body, headers={"Content-Type": content_type}, timeout=5
        )
        if status not in tuple(ok):
            raise ApiError(method, path, status, data)
        return data

    def get(self, path: str) -> dict[str, Any] | None:
        status, data = http_json("GET", self.server.url + path, timeout=5)
        if status == 404:
            return None
        if status != 200:
            raise ApiError("GET", path, status, data)
        return data

    def merge(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self.call("PATCH", path, patch, content_type="application/merge-patch+json")

    def items(self, path: str) -> list[dict[str, Any]]:
        return self.call("GET", path)["items"]

    # -- paths -------------------------------------------------------------------------------------
    def pods_path(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.ns}/pods" + (f"/{name}" if name else "")

    def smgw_path(self, name: str = "") -> str:
        return f"/apis/smg.dev/v1alpha1/namespaces/{self.ns}/smgworkers" + (f"/{name}" if name else "")

    # -- pods: the test is the kubelet ------------------------------------------------------------
    def create_pod(
        self,
        name: str,
        *,
        labels: Mapping[str, str],
        ip: str,
        ready: bool = True,
        annotations: Mapping[str, str] | None = None,
        hold: bool = True,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.ns, "labels": dict(labels)}
        if annotations:
            meta["annotations"] = dict(annotations)
        if hold:
            meta["finalizers"] = [HOLD_FINALIZER]
        self.call(
            "POST",
            self.pods_path(),
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": meta,
                "spec": {"containers": [{"name": "main", "image": "smg:test"}]},
            },
        )
        return self.set_pod_status(name, ip=ip, ready=ready)

    def set_pod_status(self, name: str, *, ip: str, ready: bool) -> dict[str, Any]:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": "True" if ready else "False", "lastTransitionTime": now},
            ],
        }
        return self.merge(self.pods_path(name) + "/status", {"status": status})

    def terminate_pod(self, name: str) -> dict[str, Any]:
        """DELETE: with the hold finalizer, the pod stays, terminating (deletionTimestamp set)."""
        return self.call("DELETE", self.pods_path(name))

    def release_pod(self, name: str) -> None:
        """Drop the hold finalizer: a terminating pod is then gone."""
        self.merge(self.pods_path(name), {"metadata": {"finalizers": None}})

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.get(self.pods_path(name))

    def create_service(self, name: str, selector: Mapping[str, str], port: int) -> dict[str, Any]:
        return self.call(
            "POST",
            f"/api/v1/namespaces/{self.ns}/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": self.ns},
                "spec": {"selector": dict(selector), "ports": [{"name": "http", "port": port, "targetPort": port}]},
            },
        )

    # -- SMGWorkers --------------------------------------------------------------------------------
    def create_smgworker(self, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        return self.call(
            "POST",
            self.smgw_path(),
            {
                "apiVersion": "smg.dev/v1alpha1",
                "kind": "SMGWorker",
                "metadata": {"name": name, "namespace": self.ns},
                "spec": dict(spec),
            },
        )

    def smgworker(self, name: str) -> dict[str, Any] | None:
        return self.get(self.smgw_path(name))

    def status(self, name: str) -> dict[str, Any]:
        return (self.smgworker(name) or {}).get("status") or {}

    def condition(self, name: str, ctype: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions") or [] if c.get("type") == ctype), {})

    def events(self, name: str) -> list[dict[str, Any]]:
        """core/v1 Events about the SMGWorker ``name`` (oldest first)."""
        return [
            e
            for e in self.items(f"/api/v1/namespaces/{self.ns}/events")
            if (e.get("involvedObject") or {}).get("name") == name
            and (e.get("involvedObject") or {}).get("kind") == "SMGWorker"
        ]

    def event_reasons(self, name: str) -> list[str]:
        return [e.get("reason") for e in self.events(name)]


def Operator(tmp: Path, kubeconfig: Path) -> OperatorProcess:
    """``python -m smg_operator`` as a subprocess, logged in to the emulator through a kubeconfig."""
    return OperatorProcess(
        tmp,
        kubeconfig,
        admin_key=ADMIN_KEY,
        args=[
            "--reconcile-interval",
            str(RECONCILE_INTERVAL),
            "--router-timeout",
            str(ROUTER_TIMEOUT),
            "--log-level",
            "info",
            # the tenancy allow-lists (docs/operator.md): only the operator's own default router is allowed unless
            # listed, and the static endpoints these tests start on 127.0.0.x are loopback, refused unless listed
            "--allowed-router-service",
            f"{NAMESPACE}/{ROUTER_SERVICE}",
            "--allowed-endpoint",
            LOOPBACK,
        ],
    )


def start_router_at(tmp: Path, host: str, port: int) -> Router:
    """An ``smg-router`` on ``host:port`` (a replica's pod IP and the Service's port), admin key required."""
    return start_router(tmp, host=host, port=port, admin_key=ADMIN_KEY)


def start_sim_at(tmp: Path, host: str, port: int, extra: Iterable[str] = ()) -> Sim:
    return start_sim(tmp, host=host, port=port, extra=list(extra))


class Fleet:
    """The processes behind the emulator's pods: router replicas and workers, each on its own loopback IP."""

    def __init__(self, tmp: Path, kube: Kube) -> None:
        self.tmp, self.kube = tmp, kube
        self.router_port = free_port()
        self.worker_port = free_port()
        self.routers: dict[str, Router] = {}
        self.router_hosts: dict[str, str] = {}
        self.sims: dict[str, Sim] = {}
        self._stopped: set[int] = set()

    # -- router replicas ---------------------------------------------------------------------------
    def router_service(self) -> None:
        self.kube.create_service(ROUTER_SERVICE, ROUTER_LABELS, self.router_port)

    def add_router(self, pod: str) -> Router:
        host = next_host()
        self.router_hosts[pod] = host
        self.routers[pod] = start_router_at(self.tmp, host, self.router_port)
        self.kube.create_pod(pod, labels=ROUTER_LABELS, ip=host)
        return self.routers[pod]

    def add_routers(self, *pods: str) -> list[Router]:
        """Several replicas, their processes started side by side (each takes ~0.5 s to come up)."""
        with concurrent.futures.ThreadPoolExecutor(len(pods)) as pool:
            return list(pool.map(self.add_router, pods))

    def stop_router(self, pod: str) -> None:
        self.routers[pod].stop()

    def restart_router(self, pod: str) -> Router:
        """A new process on the same IP and port: the pod's container restarted, its registry is empty."""
        self.routers[pod].stop()
        self.routers[pod] = start_router_at(self.tmp, self.router_hosts[pod], self.router_port)
        return self.routers[pod]

    @contextlib.contextmanager
    def frozen(self, pod: str):
        """SIGSTOP a router replica (it keeps its registry but answers nothing) until the block ends."""
        popen = self.routers[pod].popen
        assert popen is not None
        popen.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            popen.send_signal(signal.SIGCONT)

    # -- workers -----------------------------------------------------------------------------------
    def add_worker(
        self,
        pod: str,
        *,
        labels: Mapping[str, str],
        annotations: Mapping[str, str] | None = None,
        ready: bool = True,
        extra: Iterable[str] = (),
    ) -> Sim:
        sim = start_sim_at(self.tmp, next_host(), self.worker_port, extra)
        self.sims[pod] = sim
        self.kube.create_pod(pod, labels=labels, ip=sim.host, ready=ready, annotations=annotations)
        return sim

    def add_workers(self, *pods: str, labels: Mapping[str, str]) -> list[Sim]:
        """Several ready worker pods with the same labels, their processes started side by side."""
        with concurrent.futures.ThreadPoolExecutor(len(pods)) as pool:
            return list(pool.map(lambda pod: self.add_worker(pod, labels=labels), pods))

    def add_sim(self, key: str, extra: Iterable[str] = ()) -> Sim:
        """A worker process with no pod (a static endpoint, or one a person registers by hand)."""
        sim = start_sim_at(self.tmp, next_host(), self.worker_port, extra)
        self.sims[key] = sim
        return sim

    def stop_all(self) -> None:
        for proc in [*self.routers.values(), *self.sims.values()]:
            if proc.popen is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGCONT)  # a frozen process must be able to exit
            proc.stop()

    # -- what the routers hold ---------------------------------------------------------------------
    def workers(self, pod: str) -> list[dict[str, Any]]:
        return self.routers[pod].workers()

    def urls(self, pod: str, *, owner_uid: str | None = None) -> set[str]:
        return {
            w["url"]
            for w in self.workers(pod)
            if owner_uid is None or (w.get("labels") or {}).get(OWNER_UID) == owner_uid
        }

    def everywhere(self, urls: set[str], *, owner_uid: str | None = None) -> bool:
        """Every router replica holds exactly ``urls`` (of that owner, when given)."""
        return all(self.urls(pod, owner_uid=owner_uid) == urls for pod in self.routers)


def pool_spec(pool: str, router_port: int, worker_port: int, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "role": "regular",
        "model": MODEL,
        "selector": {"matchLabels": {"pool": pool}},
        "port": worker_port,
        "drainTimeoutSeconds": 1,
        "router": {"service": ROUTER_SERVICE, "port": router_port},
    }
    spec.update(extra)
    return spec


def wait_for(predicate: Any, *, timeout: float, what: str, interval: float = 0.05) -> Any:
    """``wait_until`` with a mandatory bound: every wait in this tier says how long is too long (``SETTLE``
    unless a test has a reason for more)."""
    return wait_until(predicate, timeout=timeout, interval=interval, what=what)


def registered_pool(kube: Kube, fleet: Fleet) -> tuple[str, set[str]]:
    """Two router replicas, two worker pods and the SMGWorker "llama" selecting them, registered everywhere.

    Returns the SMGWorker's uid and the worker URLs."""
    fleet.router_service()
    fleet.add_routers("router-0", "router-1")
    fleet.add_workers("llama-0", "llama-1", labels={"pool": "llama"})
    uid = kube.create_smgworker("llama", pool_spec("llama", fleet.router_port, fleet.worker_port))["metadata"]["uid"]
    want = {fleet.sims["llama-0"].url, fleet.sims["llama-1"].url}
    wait_for(lambda: fleet.everywhere(want, owner_uid=uid), timeout=SETTLE, what="both pods on both replicas")
    return uid, want
