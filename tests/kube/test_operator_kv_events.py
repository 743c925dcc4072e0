"""``SMGWorker.spec.kvEvents`` on a real kube-apiserver: a real smg-operator registers each pod's own KV events
endpoints (``tcp://<pod IP>:<port>``, the replay port likewise, the topic) on both real smg-router replicas, the
replicas read the events of the smg-sim behind each pod, and a pod that goes takes its registration and its
subscription with it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from smg_sim.tokenizer_files import TOKENIZER_DIR
from support.kube import ControlPlane
from support.operator_env import Env, operated_env, pool, port_free_on
from support.operator_proc import SETTLE
from support.procs import MODEL, metric_value, next_host, wait_until

TOPIC = "kv-events"
REPLICAS = ("router-0", "router-1")


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    logs = tmp_path_factory.mktemp("operator-kv-events")
    tokenizer = ["--tokenizer", f"{MODEL}={TOKENIZER_DIR}"]  # the chart's routers hold the sim's tokenizer too
    with operated_env(control_plane, logs, "kv", routers=("smg-router",), router_args=tokenizer) as e:
        yield e


def _kv_events(e: Env, pod: str) -> dict[str, Any]:
    """Worker URL -> the ``kv_events`` of its registration on router replica ``pod``."""
    return {w["url"]: w.get("kv_events") for w in e.routers[pod].workers()}


def test_each_pods_event_endpoints_reach_every_replica_and_leave_with_the_pod(env: Env) -> None:
    e = env
    hosts = [next_host(), next_host()]
    port = port_free_on(hosts)
    replay = next(p for p in iter(lambda: port_free_on(hosts), None) if p != port)
    sims = {}
    for name, host in zip(("llama-a", "llama-b"), hosts, strict=True):
        publish = [
            *("--kv-events-endpoint", f"tcp://{host}:{port}"),
            *("--kv-events-replay-endpoint", f"tcp://{host}:{replay}"),
            *("--kv-events-topic", TOPIC),
        ]
        sims[name] = e.add_worker_pod(name, {"app": "llama"}, host=host, extra=publish)
    kv_events = {"port": port, "replayPort": replay, "topic": TOPIC}
    smgworker = pool("llama", {"app": "llama"}, port=e.worker_port, router_port=e.router_port, kvEvents=kv_events)
    e.cp.apply_yaml(smgworker, e.ns)

    expected = {
        sim.url: {
            "endpoint": f"tcp://{sim.host}:{port}",
            "replay_endpoint": f"tcp://{sim.host}:{replay}",
            "topic": TOPIC,
        }
        for sim in sims.values()
    }
    try:
        wait_until(
            lambda: all(_kv_events(e, pod) == expected for pod in REPLICAS),
            timeout=SETTLE,
            what="each pod's KV events endpoints on both replicas",
        )
    except AssertionError as err:
        seen = {pod: _kv_events(e, pod) for pod in REPLICAS}
        raise AssertionError(f"{err}; registered: {seen}; status: {(e.smgw('llama') or {}).get('status')}") from None

    # the replicas subscribed to those endpoints: what one sim caches for a prompt sent through router-0 is heard,
    # as stored blocks, by both
    for pod in REPLICAS:
        e.routers[pod].wait_routable(2)
    served = e.routers["router-0"].complete("A prompt long enough to fill a few KV blocks of sixteen tokens. " * 4)
    assert served.status == 200 and served.worker_url in expected, served

    def stored(pod: str) -> float:
        text = e.routers[pod].metrics()
        return metric_value(text, "smg_kv_events_total", worker=str(served.worker_url), kind="stored")

    wait_until(lambda: all(stored(pod) >= 1 for pod in REPLICAS), timeout=10, what="its stored events on both")

    # the pod goes: its registration, its subscription and its event series leave both replicas; the other stays
    gone = next(name for name, sim in sims.items() if sim.url == served.worker_url)
    (left,) = [sim.url for name, sim in sims.items() if name != gone]
    e.cp.mark_terminating(e.ns, gone)
    wait_until(
        lambda: all(_kv_events(e, pod) == {left: expected[left]} for pod in REPLICAS),
        timeout=SETTLE,
        what="the terminating pod's registration gone from both replicas",
    )
    for pod in REPLICAS:
        text = e.routers[pod].metrics()
        series = [line for line in text.splitlines() if line.startswith("smg_kv_events") and served.worker_url in line]
        assert not series, (pod, series)
    e.cp.release_pod(e.ns, gone)
