"""Scale from zero against a real kube-apiserver: an SMGWorker whose selector matches no pod keeps its model known on
every router replica (declared with ``PUT /models/{model}``, re-declared on a new replica), so a request for it is held
or gets a 503, never a 404; deleting it withdraws the declaration, unless another SMGWorker declares the same model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.kube import ControlPlane
from support.operator_env import Env, operated_env, pool
from support.operator_proc import SETTLE
from support.procs import Router, http_json, wait_until

ZERO_MODEL = "zero/model"
"""A model name with a slash, as hub names have."""
INTERVAL = 2.0


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    logs = tmp_path_factory.mktemp("operator-zero")
    with operated_env(control_plane, logs, "zero", routers=("smg-router",), interval=INTERVAL) as e:
        yield e


def _declarers(router: Router, model: str) -> set[str]:
    status, body = http_json("GET", router.url + "/workers")
    assert status == 200, body
    return {d["owner"] for m in body.get("declared_models", []) if m["model"] == model for d in m["declarations"]}


def _status(router: Router, model: str) -> int:
    return router.complete("cold start", model=model).status


def test_an_smgworker_with_zero_pods_keeps_its_model_known_on_every_replica_until_deleted(env: Env) -> None:
    e = env
    for router in e.routers.values():  # another model, declared by hand: the router knows models, so an unknown one
        assert router.admin("PUT", "/models/by-hand")[0] == 201  # is a 404 (not "no workers at all")
        assert _status(router, ZERO_MODEL) == 404
    e.cp.apply_yaml(
        pool("zero-a", {"app": "nothing-yet"}, port=e.worker_port, router_port=e.router_port, model=ZERO_MODEL), e.ns
    )
    e.cp.apply_yaml(
        pool(
            "zero-b",
            {"app": "nothing-either"},
            port=e.worker_port,
            router_port=e.router_port,
            model=ZERO_MODEL,
            role="decode",
        ),
        e.ns,
    )
    wait_until(
        lambda: all(len(_declarers(r, ZERO_MODEL)) == 2 for r in e.routers.values()),
        timeout=SETTLE,
        what="both SMGWorkers' declarations on both replicas",
    )
    for router in e.routers.values():
        assert _status(router, ZERO_MODEL) == 503  # known: no worker now (the hold is off here), not a 404
        _, listed = http_json("GET", router.url + "/v1/models")
        (entry,) = [m for m in listed["data"] if m["id"] == ZERO_MODEL]
        assert entry["smg"]["workers"] == 0 and {d["role"] for d in entry["smg"]["declared"]} == {"regular", "decode"}

    # a new replica gets the declarations too
    new = e.add_router_pod("router-2")
    assert new.admin("PUT", "/models/by-hand")[0] == 201
    wait_until(lambda: len(_declarers(new, ZERO_MODEL)) == 2, timeout=SETTLE, what="declared on the new replica")

    # one SMGWorker deleted: the other still declares the model everywhere
    e.cp.kubectl("delete", "smgw", "zero-a", "-n", e.ns, "--wait=false")
    wait_until(lambda: e.smgw("zero-a") is None, timeout=SETTLE, what="zero-a gone (its finalizer done)")
    for router in e.routers.values():
        (owner,) = _declarers(router, ZERO_MODEL)
        assert "/zero-b@" in owner, owner
        assert _status(router, ZERO_MODEL) == 503

    # the last one deleted: the model is unknown again; the declaration made by hand stays
    e.cp.kubectl("delete", "smgw", "zero-b", "-n", e.ns, "--wait=false")
    wait_until(lambda: e.smgw("zero-b") is None, timeout=SETTLE, what="zero-b gone (its finalizer done)")
    for pod, router in e.routers.items():
        assert _declarers(router, ZERO_MODEL) == set(), pod
        assert _declarers(router, "by-hand") == {"user"}, pod
        assert _status(router, ZERO_MODEL) == 404, pod
