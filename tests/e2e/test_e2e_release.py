"""SMG as a user runs it: ``helm install smg ./charts/smg --set sim.enabled=true`` into a real cluster, then a life.

The tests run in this order on one release (each needs the state the previous left):
install with ``--wait`` → every pod Running and Ready → each SMGWorker Ready with every sim pod registered on
every router replica → OpenAI requests through the router Service, shared prefixes counted as tree hits →
sim scaled down (the pod drained and removed everywhere) and up (registered) → a rolling restart of the router
under client load with no failed request, the new replicas repaired by the operator → a real Prometheus
scraping the routers through the API server's service discovery, the dashboard's queries with data → the
kubeconfig seam → an SMGWorker deleted (deregistered everywhere) → ``helm upgrade`` keeping the admin token →
``helm uninstall`` leaving nothing behind.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import openai
import pytest
import yaml
from support.e2e_cluster import Cluster, Forward, http_get, provide_cluster
from support.procs import metric_value, wait_until
from support.prometheus import Prometheus

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "smg"
NAMESPACE = "smg-e2e"
RELEASE = "smg"
MODEL = "sim-model"
ROUTER_PORT = 30000
ADMIN_PORT = 30001
LOAD_CLIENT = Path(__file__).with_name("load_client.py")
PREFIX = "You are a careful assistant for the SMG end-to-end suite. " * 8

pytestmark = pytest.mark.timeout(900)


def values(image: str) -> dict[str, Any]:
    repository, _, tag = image.rpartition(":")
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "router": {"replicas": 2},
        "sim": {"enabled": True, "timeScale": 0.05},
    }


@dataclass
class Release:
    """The installed release and ways into it."""

    cluster: Cluster
    config: helm.Config
    image: str
    service: Forward | None = None
    forwards: list[Forward] = field(default_factory=list)

    def kubectl(self, *args: str, **kw: Any) -> str:
        return self.cluster.kubectl("-n", NAMESPACE, *args, **kw)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def pods(self, component: str) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
        return self.get("pods", "-l", selector)["items"]

    def ready_pods(self, component: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(component) if _ready(p) and not p["metadata"].get("deletionTimestamp")]

    def workers(self) -> list[dict[str, Any]]:
        return self.get("smgworkers")["items"]

    def admin_token(self) -> str:
        secret = self.get("secret", f"{RELEASE}-admin")
        return base64.b64decode(secret["data"]["admin-api-key"]).decode()

    def connect(self, target: str, port: int) -> Forward:
        forward = self.cluster.connect(NAMESPACE, target, port)
        self.forwards.append(forward)
        return forward

    @property
    def url(self) -> str:
        if self.service is None:
            self.service = self.connect(f"svc/{RELEASE}-router", ROUTER_PORT)
        return self.service.url

    def registered_on_each_router(self) -> dict[str, set[str]]:
        """Router pod name → the worker URLs its ``GET /workers`` lists (asked on each pod's own address)."""
        out: dict[str, set[str]] = {}
        for pod in self.ready_pods("router"):
            forward = self.connect(f"pod/{pod['metadata']['name']}", ROUTER_PORT)
            try:
                status, body = http_get(forward.url + "/workers")
                assert status == 200, body
                out[pod["metadata"]["name"]] = {w["url"] for w in json.loads(body)["workers"]}
            finally:
                forward.stop()
                self.forwards.remove(forward)
        return out

    def workers_on_each_router(self) -> dict[str, list[dict[str, Any]]]:
        """Router pod name → the workers its ``GET /workers`` lists, as it lists them."""
        out: dict[str, list[dict[str, Any]]] = {}
        for pod in self.ready_pods("router"):
            forward = self.connect(f"pod/{pod['metadata']['name']}", ROUTER_PORT)
            try:
                status, body = http_get(forward.url + "/workers")
                assert status == 200, body
                out[pod["metadata"]["name"]] = json.loads(body)["workers"]
            finally:
                forward.stop()
                self.forwards.remove(forward)
        return out

    def router_metrics(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for pod in self.ready_pods("router"):
            forward = self.connect(f"pod/{pod['metadata']['name']}", ROUTER_PORT)
            try:
                status, body = http_get(forward.url + "/metrics")
                assert status == 200
                out[pod["metadata"]["name"]] = body
            finally:
                forward.stop()
                self.forwards.remove(forward)
        return out

    def sim_urls(self) -> set[str]:
        return {f"http://{p['status']['podIP']}:8000" for p in self.ready_pods("sim-regular")}

    def openai(self, *, retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=retries, timeout=30)


class Load:
    """Client load on the router Service from tests/e2e/load_client.py (its own process; every failure counted).

    With the project's cluster the client runs inside the network namespace and connects to the ClusterIP
    itself (a loopback forwarder in between would add a hop whose closes lag the server's); elsewhere it goes
    through the forwarded Service URL.
    """

    def __init__(self, release: Release, threads: int = 4) -> None:
        self.release, self.threads = release, threads
        self.sent = self.failed = 0
        self.errors: list[str] = []
        self.popen: subprocess.Popen[str] | None = None

    def __enter__(self) -> Load:
        cluster = self.release.cluster
        if cluster.netns:
            ip = cluster.kubectl(
                "get", "-n", NAMESPACE, "service", f"{RELEASE}-router", "-o", "jsonpath={.spec.clusterIP}"
            )
            args = cluster.in_netns([sys.executable, str(LOAD_CLIENT), f"http://{ip}:{ROUTER_PORT}", str(self.threads)])
        else:
            args = [sys.executable, str(LOAD_CLIENT), self.release.url, str(self.threads)]
        self.popen = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.popen.stdout is not None
        assert self.popen.stdout.readline().strip() == "started", "the load client answered no request"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        self.popen.terminate()
        out, _ = self.popen.communicate(timeout=90)
        result = json.loads(out.strip().splitlines()[-1])
        self.sent, self.failed, self.errors = result["sent"], result["failed"], result["errors"]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return pod.get("status", {}).get("phase") == "Running" and conditions.get("Ready") == "True"


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return str(c["status"])
    return None


def _release_stuck_finalizers(cluster: Cluster) -> None:
    """Clean-up only (after the tests): SMGWorkers left Terminating with the operator gone would hold the namespace."""
    names = cluster.kubectl("get", "-n", NAMESPACE, "smgworkers", "-o", "name", check=False).split()
    for name in names:
        patch = '{"metadata":{"finalizers":[]}}'
        cluster.kubectl("patch", "-n", NAMESPACE, name, "--type=merge", "-p", patch, check=False)


def _everywhere(release: Release, expected: set[str]) -> bool:
    seen = release.registered_on_each_router()
    return len(seen) == 2 and all(urls == expected for urls in seen.values())


@pytest.fixture(scope="module")
def release(cluster: Cluster, image: str, figures: dict[str, Any]) -> Iterator[Release]:
    _release_stuck_finalizers(cluster)  # a run that was killed may have left some
    cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", timeout=180, check=False)
    cluster.kubectl("create", "namespace", NAMESPACE)
    config = helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=NAMESPACE)
    r = Release(cluster=cluster, config=config, image=image)
    try:
        yield r
    finally:
        for forward in r.forwards:
            forward.stop()
        with contextlib.suppress(helm.HelmError):
            config.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=60)
        _release_stuck_finalizers(cluster)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", timeout=180, check=False)
        config.close()


# ------------------------------------------------------------------------------------------------ the tests
def test_helm_install_waits_until_everything_is_ready(release: Release, figures: dict[str, Any]) -> None:
    started = time.monotonic()
    with helm.Chart.load(CHART) as chart:
        installed = release.config.install(
            chart, RELEASE, values(release.image), namespace=NAMESPACE, wait="watcher", timeout=300
        )
    figures["helm_install_wait_s"] = round(time.monotonic() - started, 1)
    assert installed["status"] == "deployed", {k: v for k, v in installed.items() if k != "manifest"}
    for component, count in (("router", 2), ("operator", 1), ("sim-regular", 2)):
        pods = release.pods(component)
        assert len(pods) == count, (component, [p["metadata"]["name"] for p in pods])
        assert all(_ready(p) for p in pods), (component, [p["status"] for p in pods])


def test_smgworkers_ready_with_every_sim_pod_on_every_router(release: Release) -> None:
    sims = release.sim_urls()
    assert len(sims) == 2

    def ready() -> bool:
        workers = release.workers()
        return bool(workers) and all(
            _condition(w, "Registered") == "True" and w["status"].get("registeredEndpoints") == len(sims)
            for w in workers
        )

    wait_until(ready, timeout=60, interval=1, what="SMGWorkers Registered with both sims")
    wait_until(lambda: _everywhere(release, sims), timeout=30, interval=1, what="both sims on both routers")
    (worker,) = release.workers()
    assert len(worker["status"]["routers"]) == 2, worker["status"]


def test_openai_requests_through_the_service_and_tree_hits(release: Release) -> None:
    before = sum(metric_value(t, "smg_cache_tree_hits_total") for t in release.router_metrics().values())
    with release.openai() as client:
        assert MODEL in [m.id for m in client.models.list().data]
        for i in range(12):
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{PREFIX} question {i}"}], max_tokens=4
            )
            assert reply.choices[0].message.content
        with client.completions.create(model=MODEL, prompt=PREFIX + " streamed", max_tokens=4, stream=True) as stream:
            assert "".join(c.choices[0].text for c in stream if c.choices)
    after = sum(metric_value(t, "smg_cache_tree_hits_total") for t in release.router_metrics().values())
    assert after - before >= 8, f"tree hits went from {before} to {after} over 12 shared-prefix requests"


def test_the_routers_follow_the_sims_kv_events_and_a_repeated_prefix_lands_on_one_sim(
    release: Release, figures: dict[str, Any]
) -> None:
    """The chart's sims publish KV events, their SMGWorkers carry spec.kvEvents, and the routers hold the sim's
    tokenizer from the image: every router subscribes to every sim, and a long prefix asked again and again through
    the Service is stored by one sim only and answered from its cache."""
    sims = release.sim_urls()
    ips = {url.removeprefix("http://").rpartition(":")[0] for url in sims}
    for pod, workers in release.workers_on_each_router().items():
        events = {w["url"]: w.get("kv_events") for w in workers}
        assert events == {
            f"http://{ip}:8000": {"endpoint": f"tcp://{ip}:5557", "replay_endpoint": f"tcp://{ip}:5558", "topic": ""}
            for ip in ips
        }, (pod, events)
    wait_until(
        lambda: all(
            metric_value(text, "smg_kv_events_synced", worker=url) == 1
            for text in release.router_metrics().values()
            for url in sims
        ),
        timeout=60,
        interval=1,
        what="both routers routing on both sims' events",
    )
    before = release.router_metrics()
    prefix = "A long document every question of this test repeats, word for word, to the same engine. " * 20
    cached = []
    with release.openai() as client:
        for i in range(10):
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{prefix} question {i}"}], max_tokens=2
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)

    def stored() -> dict[str, dict[str, float]]:
        """Router pod -> sim -> the sim's stored events that router read since ``before``."""
        after = release.router_metrics()
        return {
            pod: {
                url: metric_value(after[pod], "smg_kv_events_total", worker=url, kind="stored")
                - metric_value(before.get(pod, ""), "smg_kv_events_total", worker=url, kind="stored")
                for url in sims
            }
            for pod in after
        }

    def alike() -> dict[str, dict[str, float]] | None:
        """``stored()`` once both routers counted the same (they read the same streams), else None."""
        counts = stored()
        same = len({json.dumps(c, sort_keys=True) for c in counts.values()}) == 1
        return counts if len(counts) == 2 and same else None

    counts = wait_until(alike, timeout=30, interval=1, what="the same stored events counted on both routers")
    figures["kv_events"] = {"stored_events_by_router": counts, "cached_tokens": cached}
    by_sim = next(iter(counts.values()))
    storing = [url for url, n in by_sim.items() if n > 0]
    assert len(storing) == 1, f"stored events per router and sim: {counts}"  # the prefix's one engine, heard by both
    assert all(n >= len(prefix) for n in cached[1:]), f"cached tokens per request: {cached}"


def test_sim_scaled_down_is_drained_and_removed_everywhere_then_up_registered(
    release: Release, figures: dict[str, Any]
) -> None:
    deployment = f"deployment/{RELEASE}-sim-regular"
    before = release.sim_urls()
    assert len(before) == 2
    with Load(release, threads=2) as load:
        release.kubectl("scale", deployment, "--replicas=1")
        wait_until(lambda: len(release.pods("sim-regular")) == 1, timeout=120, interval=1, what="one sim pod left")
        (left,) = release.sim_urls()
        wait_until(lambda: _everywhere(release, {left}), timeout=60, interval=1, what="the removed sim gone everywhere")
    figures["scale_down_requests"] = {"sent": load.sent, "failed": load.failed}
    assert load.failed == 0, load.errors[:5]
    release.kubectl("scale", deployment, "--replicas=2")
    wait_until(lambda: len(release.sim_urls()) == 2, timeout=120, interval=1, what="two sims Ready again")
    sims = release.sim_urls()
    wait_until(lambda: _everywhere(release, sims), timeout=60, interval=1, what="the new sim registered everywhere")


def test_rolling_restart_of_the_router_under_load_fails_no_request(release: Release, figures: dict[str, Any]) -> None:
    if not release.cluster.netns:
        pytest.skip(
            f"the {release.cluster.backend} backend reaches the Service by kubectl port-forward, which pins one pod "
            "(a restart cuts it by design); the ClusterIP path needs the project's cluster"
        )
    old = {p["metadata"]["name"] for p in release.pods("router")}
    with Load(release, threads=4) as load:
        started = time.monotonic()
        release.kubectl("rollout", "restart", f"deployment/{RELEASE}-router")
        release.kubectl("rollout", "status", f"deployment/{RELEASE}-router", "--timeout=300s", timeout=320)
        wait_until(
            lambda: not ({p["metadata"]["name"] for p in release.pods("router")} & old),
            timeout=180,
            interval=1,
            what="the old router pods gone",
        )
        rollout_s = time.monotonic() - started
        sims = release.sim_urls()
        wait_until(lambda: _everywhere(release, sims), timeout=60, interval=1, what="the new routers repaired")
    figures["rolling_restart"] = {
        "sent": load.sent,
        "failed": load.failed,
        "rollout_s": round(rollout_s, 1),
    }
    assert load.failed == 0, f"{load.failed} of {load.sent} failed: {load.errors[:5]}"
    assert load.sent >= 50, load.sent


# -- Prometheus through the API server's service discovery -------------------------------------------------------
DASHBOARD = json.loads((REPO / "dashboards" / "smg.json").read_text())
PANELS_WITH_DATA = (
    "Tree hit rate",
    "Requests / s",
    "Healthy workers",
    "Request rate by endpoint",
    "Worker health",
    "Router replicas: workers known",
    "Registered workers per SMGWorker",
    "Reconciles by result",
)


SERVICE_MONITORS = ((f"{RELEASE}-router", "http"), (f"{RELEASE}-operator-metrics", "metrics"))
"""(Service, port name) of the chart's two ServiceMonitors."""


class EndpointsDiscovery:
    """What kubernetes_sd (role endpoints) + the Prometheus Operator's relabelling make of the chart's ServiceMonitors.

    Debian's Prometheus is built without kubernetes_sd, so this thread plays it: it reads the Services'
    Endpoints from the API server every second and writes one target per ready pod address, with the labels
    the Operator sets (job = the Service's name, namespace, pod, service, endpoint), to a file_sd file.
    """

    def __init__(self, release: Release, path: Path) -> None:
        self.release, self.path = release, path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.write()

    def targets(self) -> list[dict[str, Any]]:
        groups = []
        for service, port_name in SERVICE_MONITORS:
            endpoints = self.release.get("endpoints", service)
            for subset in endpoints.get("subsets") or []:
                ports = [p["port"] for p in subset.get("ports", []) if p.get("name") == port_name]
                for address in subset.get("addresses") or []:
                    for port in ports:
                        labels = {"namespace": NAMESPACE, "service": service, "job": service, "endpoint": port_name}
                        labels["pod"] = (address.get("targetRef") or {}).get("name", "")
                        groups.append({"targets": [f"{address['ip']}:{port}"], "labels": labels})
        return groups

    def write(self) -> None:
        part = self.path.with_suffix(".part")
        part.write_text(json.dumps(self.targets()))
        part.replace(self.path)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                self.write()

    def __enter__(self) -> EndpointsDiscovery:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _panels() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
            if exprs:
                out[panel["title"]] = exprs
            walk(panel.get("panels", []))

    walk(DASHBOARD["panels"])
    return out


def _grafana(expr: str) -> str:
    for var, value in (("$__rate_interval", "1m"), ("$__interval", "5s"), ("$__range", "10m")):
        expr = expr.replace(var, value)
    return expr.replace("${namespace}", NAMESPACE).replace("$namespace", NAMESPACE)


def test_prometheus_scrapes_the_routers_found_through_the_api_server(
    release: Release, tmp_path: Path, figures: dict[str, Any]
) -> None:
    cluster = release.cluster
    if not cluster.netns:
        pytest.skip(f"the {cluster.backend} backend gives no route to pod IPs for a Prometheus outside the cluster")
    sd_file = tmp_path / "endpoints.json"
    discovery = EndpointsDiscovery(release, sd_file)
    config = {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [
            {
                "job_name": "chart-servicemonitors",
                "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = 19090
    args = cluster.in_netns(
        [
            "/usr/bin/prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    try:
        discovery.__enter__()
        forward = release.connect("ip/127.0.0.1", port)
        prom = Prometheus(proc=None, url=forward.url)  # type: ignore[arg-type]  # only its queries are used

        def prometheus_ready() -> bool:  # a starting Prometheus answers its API with a plain-text 503
            with urllib.request.urlopen(forward.url + "/-/ready", timeout=2) as resp:
                return resp.status == 200

        wait_until(prometheus_ready, timeout=60, interval=1, what="prometheus /-/ready")

        def routers_up() -> bool:
            targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
            up = [t for t in targets if t["health"] == "up"]
            return len([t for t in up if t["labels"]["job"] == f"{RELEASE}-router"]) == 2 and len(up) == 3

        wait_until(routers_up, timeout=60, interval=1, what="2 router pods and the operator scraped")
        with release.openai() as client:
            for i in range(10):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"{PREFIX} dashboard {i}"}], max_tokens=2
                )
        panels = _panels()
        for title, exprs in panels.items():
            for expr in exprs:
                answer = prom.query(_grafana(expr))
                assert answer["status"] == "success", (title, expr, answer)

        def without_data() -> list[str]:
            return [t for t in PANELS_WITH_DATA if not any(prom.vector(_grafana(e)) for e in panels[t])]

        wait_until(lambda: not without_data(), timeout=60, interval=2, what=f"data in the panels {PANELS_WITH_DATA}")
    finally:
        discovery.__exit__()
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


# -- the kubeconfig seam -----------------------------------------------------------------------------------------
def test_the_suite_runs_on_an_existing_cluster_through_its_kubeconfig(release: Release) -> None:
    """SMG_E2E_KUBECONFIG: the same checks through kubectl and port-forward only, here on the harness's cluster."""

    env = {"SMG_E2E_KUBECONFIG": str(release.cluster.kubeconfig), "SMG_E2E_IMAGE": release.image}
    provider = provide_cluster(env)
    existing = next(provider)
    try:
        assert existing.backend == "kubeconfig" and existing.netns is None and existing.build_image is None
        nodes = json.loads(existing.kubectl("get", "nodes", "-o", "json"))["items"]
        assert [_condition(n, "Ready") for n in nodes] == ["True"]
        other = Release(cluster=existing, config=release.config, image=release.image)
        sims = other.sim_urls()
        assert _everywhere(other, sims), "every sim on every router, asked through port-forward"
        with other.openai() as client:
            assert client.completions.create(model=MODEL, prompt=PREFIX + " seam", max_tokens=2).choices
        for forward in other.forwards:
            forward.stop()
    finally:
        with pytest.raises(StopIteration):
            next(provider)  # an existing cluster is left as it is
    assert json.loads(release.kubectl("get", "nodes", "-o", "json"))["items"], "the cluster is still there"


# -- the end of the release --------------------------------------------------------------------------------------
def test_deleting_an_smgworker_deregisters_it_everywhere(release: Release) -> None:
    (worker,) = release.workers()
    name = worker["metadata"]["name"]
    assert _everywhere(release, release.sim_urls())
    release.kubectl("delete", "smgworker", name, "--timeout=60s", timeout=90)  # waits for the finalizer
    assert not release.workers()
    wait_until(lambda: _everywhere(release, set()), timeout=30, interval=1, what="no worker left on any router")


def test_helm_upgrade_keeps_the_admin_token(release: Release) -> None:
    token = release.admin_token()
    assert len(token) >= 16
    with helm.Chart.load(CHART) as chart:
        upgraded = release.config.upgrade(
            chart, RELEASE, values(release.image), namespace=NAMESPACE, wait="watcher", timeout=300
        )
    assert upgraded["status"] == "deployed", {k: v for k, v in upgraded.items() if k != "manifest"}
    assert release.admin_token() == token
    sims = release.sim_urls()  # the upgrade put the deleted SMGWorker back; the operator registers it again
    wait_until(lambda: _everywhere(release, sims), timeout=60, interval=1, what="the SMGWorker back everywhere")


def test_helm_uninstall_leaves_nothing_behind(release: Release) -> None:
    for forward in release.forwards:
        forward.stop()
    release.forwards.clear()
    release.service = None
    release.config.uninstall(RELEASE, wait="watcher", timeout=120)

    def left() -> list[str]:
        kinds = "all,smgworkers,secrets,configmaps,serviceaccounts,roles,rolebindings,poddisruptionbudgets,leases"
        names = release.kubectl("get", kinds, "-o", "name").split()
        defaults = ("secret/default-token-", "serviceaccount/default", "configmap/kube-root-ca")
        return [n for n in names if not n.startswith(defaults)]

    wait_until(lambda: not left(), timeout=120, interval=1, what=f"nothing left in {NAMESPACE}")
    cluster_scoped = release.cluster.kubectl(
        "get", "clusterroles,clusterrolebindings", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name"
    )
    assert not cluster_scoped.split(), cluster_scoped
