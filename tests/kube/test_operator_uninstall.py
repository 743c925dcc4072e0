"""``smg-operator-uninstall``, the chart's pre-delete hook, against a real kube-apiserver and a running operator:
it deletes only the SMGWorkers its selector picks, returns once the operator has deregistered them from every
router replica and released them, and fails naming the ones that stay (without it, ``helm uninstall`` left
SMGWorkers Terminating)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from support.kube import ControlPlane
from support.operator_env import Env, operated_env, pool
from support.operator_proc import SETTLE
from support.procs import wait_until

RELEASE = {"app.kubernetes.io/instance": "rel"}
SELECTOR = "app.kubernetes.io/instance=rel"
REPLICAS = ("router-0", "router-1")


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with operated_env(control_plane, tmp_path_factory.mktemp("operator-uninstall"), "un", routers=["smg-router"]) as e:
        yield e


def labelled(manifest: str, labels: dict[str, str], finalizers: list[str] | None = None) -> str:
    obj = json.loads(manifest)
    obj["metadata"]["labels"] = labels
    if finalizers:
        obj["metadata"]["finalizers"] = finalizers
    return json.dumps(obj)


def uninstall(e: Env, selector: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(e.cp.kubeconfig), "KUBERNETES_SERVICE_HOST": ""}
    argv = [sys.executable, "-m", "smg_operator.uninstall", "--namespace", e.ns, "--selector", selector]
    return subprocess.run(
        [*argv, "--timeout", str(timeout), "--poll-interval", "0.2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 30,
    )


def test_it_deletes_the_releases_smgworkers_and_returns_once_the_operator_released_them(env: Env) -> None:
    e = env
    mine = [e.add_worker_pod(f"mine-{i}", {"app": "mine"}) for i in range(2)]
    theirs = e.add_worker_pod("theirs-0", {"app": "theirs"})
    e.cp.apply_yaml(
        labelled(pool("mine", {"app": "mine"}, port=e.worker_port, router_port=e.router_port), RELEASE), e.ns
    )
    e.cp.apply_yaml(pool("theirs", {"app": "theirs"}, port=e.worker_port, router_port=e.router_port), e.ns)
    wanted = {s.url for s in [*mine, theirs]}
    wait_until(lambda: all(wanted <= e.urls(r) for r in REPLICAS), timeout=SETTLE, what="every worker on every replica")

    t0 = time.monotonic()
    done = uninstall(e, SELECTOR, timeout=SETTLE)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert "deleting 1 SMGWorker(s)" in done.stderr and ": mine" in done.stderr, done.stderr
    # when it returns, the SMGWorker is gone and its workers are on no replica: nothing left for Helm to strand
    assert e.smgw("mine") is None
    for replica in REPLICAS:
        assert not {s.url for s in mine} & e.urls(replica), replica
        assert theirs.url in e.urls(replica), replica  # another SMGWorker of the namespace is untouched
    assert e.smgw("theirs") is not None and "deletionTimestamp" not in e.smgw("theirs")["metadata"]
    print(f"uninstall hook returned after {took:.2f}s")

    again = uninstall(e, SELECTOR, timeout=5)  # nothing (left) to delete: a second run is a no-op
    assert again.returncode == 0, again.stderr
    assert "deleting 0 SMGWorker(s)" in again.stderr, again.stderr


def test_it_fails_naming_the_smgworkers_that_stay(env: Env) -> None:
    """A finalizer nobody removes (here a test's own; in life an operator that is not running): exit 1 at the
    deadline, naming it, so that ``helm uninstall`` stops instead of stranding it."""
    e = env
    held = {"app.kubernetes.io/instance": "held"}
    manifest = pool("held", {"app": "nobody"}, port=e.worker_port, router_port=e.router_port)
    e.cp.apply_yaml(labelled(manifest, held, finalizers=["smg.test/hold"]), e.ns)
    path = f"/apis/smg.dev/v1alpha1/namespaces/{e.ns}/smgworkers/held"
    try:
        t0 = time.monotonic()
        done = uninstall(e, "app.kubernetes.io/instance=held", timeout=3)
        took = time.monotonic() - t0
        assert done.returncode == 1, done.stderr
        assert "still present after 3 s: held" in done.stderr, done.stderr
        assert "--no-hooks" in done.stderr, done.stderr
        assert 3 <= took < 3 + 15, took
        assert (e.smgw("held") or {}).get("metadata", {}).get("deletionTimestamp"), "deletion was not asked for"
    finally:
        obj = e.smgw("held")
        if obj is not None:
            finalizers = [f for f in obj["metadata"].get("finalizers", []) if f != "smg.test/hold"]
            e.cp.api(
                "PATCH",
                path,
                {"metadata": {"finalizers": finalizers or None}},
                content_type="application/merge-patch+json",
            )
    wait_until(lambda: e.smgw("held") is None, timeout=SETTLE, what="the held SMGWorker released")
