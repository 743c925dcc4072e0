"""End to end on a kind cluster: build the image, load it into kind, install the chart with the simulated fleet,
send OpenAI requests through the router Service, and check the SMGWorker status and the tree-hit metrics.

Opt-in: ``python -m pytest e2e`` (the default run collects only ``tests/``).  Skips, with the reason, when
kind, docker or kubectl is missing or the Docker engine does not answer.  Environment:

* ``SMG_E2E_CLUSTER`` — kind cluster name (default ``smg-e2e``); an existing cluster of that name is reused
  and kept, one this test creates is deleted at the end unless ``SMG_E2E_KEEP=1``.
* ``SMG_E2E_IMAGE`` — image tag to build and load (default ``smg:e2e``).

All traffic goes to 127.0.0.1: kind's API server and ``kubectl port-forward`` listen on loopback.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "smg"
TOOLS = ("kind", "docker", "kubectl")

_missing = [tool for tool in TOOLS if shutil.which(tool) is None]
if _missing:
    pytest.skip(f"kind e2e needs {', '.join(TOOLS)} on PATH; missing: {', '.join(_missing)}", allow_module_level=True)
_docker = subprocess.run(
    ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=60
)
if _docker.returncode != 0:
    pytest.skip(
        f"kind e2e needs a running Docker engine; docker info failed: {_docker.stderr.strip()[:200]}",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(1800)

CLUSTER = os.environ.get("SMG_E2E_CLUSTER", "smg-e2e")
IMAGE = os.environ.get("SMG_E2E_IMAGE", "smg:e2e")
RELEASE = "smg"
MODEL = "sim-model"


def run(*args: str, timeout: float = 300, env: dict[str, str] | None = None, check: bool = True) -> str:
    proc = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (AssertionError, OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@dataclass
class Cluster:
    kubeconfig: Path
    namespace: str

    def kubectl(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        return run(
            "kubectl", "--kubeconfig", str(self.kubeconfig), "-n", self.namespace, *args, timeout=timeout, check=check
        )

    def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("kind")
    existing = run("kind", "get", "clusters").split()
    created = CLUSTER not in existing
    if created:
        run("kind", "create", "cluster", "--name", CLUSTER, "--wait", "180s", timeout=600)
    try:
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(run("kind", "get", "kubeconfig", "--name", CLUSTER))
        run("docker", "build", "-t", IMAGE, str(REPO), timeout=1200, env={"DOCKER_BUILDKIT": "1"})
        run("kind", "load", "docker-image", IMAGE, "--name", CLUSTER, timeout=600)
        yield Cluster(kubeconfig=kubeconfig, namespace=f"smg-e2e-{uuid.uuid4().hex[:6]}")
    finally:
        if created and os.environ.get("SMG_E2E_KEEP") != "1":
            run("kind", "delete", "cluster", "--name", CLUSTER, timeout=300, check=False)


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[dict[str, Any]]:
    import helm_python as helm

    repository, _, tag = IMAGE.rpartition(":")
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "router": {"replicas": 2, "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}},
        "operator": {"reconcileInterval": 3},
        "sim": {"enabled": True, "timeScale": 0.05, "regular": {"replicas": 2}},
    }
    config = helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=cluster.namespace)
    try:
        # No Helm wait: the pods' readiness is checked below, each with a message that says what is missing.
        summary = config.install(
            CHART, RELEASE, values, namespace=cluster.namespace, create_namespace=True, timeout=300
        )
        yield summary
    finally:
        config.uninstall(RELEASE, ignore_not_found=True, timeout=300)
        cluster.kubectl("delete", "namespace", cluster.namespace, "--wait=false", check=False)
        config.close()


@pytest.fixture(scope="module")
def router_url(cluster: Cluster, release: dict[str, Any]) -> Iterator[str]:
    # Router pods become Ready only once they have a routable worker (registered by the operator): the tests
    # below wait for that themselves; port-forward needs a running pod only.
    for deployment in ("smg-operator", "smg-sim-regular"):
        cluster.kubectl("rollout", "status", f"deployment/{deployment}", "--timeout=300s", timeout=330)
    wait_for(
        lambda: (
            "Running"
            in cluster.kubectl(
                "get", "pods", "-l", "app.kubernetes.io/component=router", "-o", "jsonpath={.items[*].status.phase}"
            )
        ),
        timeout=300,
        what="a running router pod",
    )
    forward = subprocess.Popen(
        [
            "kubectl",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "-n",
            cluster.namespace,
            "port-forward",
            "--address",
            "127.0.0.1",
            "svc/smg-router",
            "0:30000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        match = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert match, f"kubectl port-forward said: {line}"
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def http_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def test_smgworker_gets_registered(cluster: Cluster, router_url: str) -> None:
    def registered() -> dict[str, Any] | None:
        status = cluster.get_json("smgworker", "smg-sim-regular").get("status", {})
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        ok = status.get("readyEndpoints") == 2 and status.get("registeredEndpoints") == 2
        return status if ok and conditions.get("Registered") == "True" else None

    status = wait_for(registered, timeout=180, what="SMGWorker smg-sim-regular with 2 registered endpoints")
    assert len(status.get("routers", [])) == 2, status
    workers = json.loads(http_get(router_url + "/workers"))["workers"]
    assert len(workers) == 2 and {w["role"] for w in workers} == {"regular"}


def test_openai_requests_through_the_router_service_hit_the_tree(cluster: Cluster, router_url: str) -> None:
    import openai

    wait_for(
        lambda: json.loads(http_get(router_url + "/readiness"))["status"] == "ready",
        timeout=180,
        what="router readiness",
    )
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=2, timeout=30)
    system = "You are the SMG end-to-end test. " * 20
    for i in range(12):
        answer = client.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}"}],
        )
        assert answer.choices[0].message.content is not None
    assert [m.id for m in client.models.list()] == [MODEL]
    metrics = http_get(router_url + "/metrics")
    hits = sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("smg_cache_tree_hits_total{")
    )
    assert hits > 0, metrics


def test_admin_token_protects_the_lifecycle_api(cluster: Cluster, router_url: str) -> None:
    import urllib.error
    import urllib.request

    secret = cluster.get_json("secret", "smg-admin")
    token = base64.b64decode(secret["data"]["admin-api-key"]).decode()
    assert len(token) == 32
    request = urllib.request.Request(
        router_url + "/workers",
        method="POST",
        data=b'{"url": "http://127.0.0.1:9"}',
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 401
