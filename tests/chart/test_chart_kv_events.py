"""KV events in the chart: the simulated fleet publishes them (``sim.kvEvents``), its SMGWorkers say where
(``spec.kvEvents``), and the router tokenizes the models named in ``router.tokenizers`` (SMG_TOKENIZER), the sim's
model included from the tokenizer the image holds.  The cluster side: tests/e2e (routing on the sims' events) and
tests/kube/test_operator_kv_events.py (the operator's registrations on a real API server)."""

from __future__ import annotations

from typing import Any

import pytest
from smg_router.settings import parse_settings
from smg_sim.__main__ import build_parser, config_from_args
from support.helm_chart import REPO, Rendered, render

SIM_TOKENIZER = "/opt/smg/tokenizers/smg-sim"
"""Where the image keeps smg-sim's tokenizer (the Dockerfile's builder stage copies it there)."""


def _container(r: Rendered, deployment: str) -> dict[str, Any]:
    container: dict[str, Any] = r.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
    return container


def _router_env(r: Rendered) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in _container(r, "smg-router")["env"]}


def _router_settings(r: Rendered, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the router parses from the environment the chart gives it."""
    for name, value in _router_env(r).items():
        if value is not None:
            monkeypatch.setenv(name, value)
    return parse_settings([])


@pytest.mark.parametrize(
    "values, pools",
    [
        ({"sim": {"enabled": True}}, ["regular"]),
        (
            {"router": {"pd": {"enabled": True}}, "sim": {"enabled": True, "pd": {"enabled": True}}},
            ["prefill", "decode"],
        ),
    ],
)
def test_each_sim_pool_publishes_its_kv_events_and_its_smgworker_says_where(
    values: dict[str, Any], pools: list[str]
) -> None:
    r = render(values)
    for role in pools:
        container = _container(r, f"smg-sim-{role}")
        config = config_from_args(build_parser().parse_args(container["args"]))  # smg-sim takes the args
        assert config.kv_events_endpoint == "tcp://0.0.0.0:5557"  # every address of the pod: the routers connect
        assert config.kv_events_replay_endpoint == "tcp://0.0.0.0:5558"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["kv-events"] == 5557 and ports["kv-replay"] == 5558
        spec = r.get("SMGWorker", f"smg-sim-{role}")["spec"]
        assert spec["kvEvents"] == {"port": 5557, "replayPort": 5558}


def test_the_router_tokenizes_the_sim_model_with_the_tokenizer_the_image_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = _router_settings(render({"sim": {"enabled": True, "model": "tiny"}}), monkeypatch)
    assert settings.routing.tokenizers == (("tiny", SIM_TOKENIZER),)
    builder = (REPO / "Dockerfile").read_text().split("FROM ${BASE_IMAGE}\n")[0]
    assert f"{SIM_TOKENIZER} " in builder or f"{SIM_TOKENIZER}\n" in builder, "the image puts it there"


def test_tokenizers_from_values_come_first_and_one_for_the_sim_model_replaces_the_images(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizers = [
        {"model": "meta-llama/Llama-3.1-8B-Instruct", "path": "/tokenizers/llama"},
        {"model": "sim-model", "path": "/tokenizers/sim/tokenizer.json"},
    ]
    r = render({"sim": {"enabled": True}, "router": {"tokenizers": tokenizers}})
    assert _router_settings(r, monkeypatch).routing.tokenizers == (
        ("meta-llama/Llama-3.1-8B-Instruct", "/tokenizers/llama"),
        ("sim-model", "/tokenizers/sim/tokenizer.json"),
    )


def test_the_notes_say_what_the_routers_follow() -> None:
    assert "The sims publish their KV events (port 5557)" in render({"sim": {"enabled": True}}).notes
    assert "KV events" not in render({"sim": {"enabled": True, "kvEvents": {"enabled": False}}}).notes
    tokenizers = [{"model": "a", "path": "/t/a"}, {"model": "b", "path": "/t/b"}]
    assert "The router tokenizes the prompts of a, b:" in render({"router": {"tokenizers": tokenizers}}).notes


def test_tokenizer_files_are_mounted_with_extra_volumes() -> None:
    volume = {"name": "tokenizers", "configMap": {"name": "llama-tokenizer"}}
    mount = {"name": "tokenizers", "mountPath": "/tokenizers/llama", "readOnly": True}
    r = render(
        {
            "router": {
                "tokenizers": [{"model": "llama", "path": "/tokenizers/llama"}],
                "extraVolumes": [volume],
                "extraVolumeMounts": [mount],
            }
        }
    )
    spec = r.get("Deployment", "smg-router")["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "tmp", "emptyDir": {}}, volume]
    assert spec["containers"][0]["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}, mount]
    assert _router_env(r)["SMG_TOKENIZER"] == "llama=/tokenizers/llama"


@pytest.mark.parametrize(
    "values",
    [{}, {"sim": {"enabled": True, "kvEvents": {"enabled": False}}}],
    ids=["no sims", "sims without events"],
)
def test_without_sim_events_or_tokenizers_the_router_tokenizes_nothing(
    values: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    r = render(values)
    assert "SMG_TOKENIZER" not in _router_env(r)
    assert _router_settings(r, monkeypatch).routing.tokenizers == ()
    for worker in r.of_kind("SMGWorker"):
        assert "kvEvents" not in worker["spec"]
    for deployment in r.of_kind("Deployment"):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert "--kv-events-endpoint" not in container.get("args", [])
        assert not [p for p in container["ports"] if p["name"].startswith("kv-")]


def test_other_event_ports_reach_the_sims_and_their_smgworkers() -> None:
    r = render({"sim": {"enabled": True, "kvEvents": {"port": 7000, "replayPort": 7001}}})
    args = _container(r, "smg-sim-regular")["args"]
    assert args[args.index("--kv-events-endpoint") + 1] == "tcp://0.0.0.0:7000"
    assert args[args.index("--kv-events-replay-endpoint") + 1] == "tcp://0.0.0.0:7001"
    assert r.get("SMGWorker", "smg-sim-regular")["spec"]["kvEvents"] == {"port": 7000, "replayPort": 7001}


@pytest.mark.parametrize(
    "values",
    [
        {"sim": {"enabled": True, "kvEvents": {"port": 8000}}},
        {"sim": {"enabled": True, "kvEvents": {"replayPort": 5557}}},
        {
            "router": {"pd": {"enabled": True}},
            "sim": {"enabled": True, "pd": {"enabled": True, "bootstrapPort": 5558}},
        },
    ],
    ids=["events on the http port", "replay on the events port", "replay on the bootstrap port"],
)
def test_event_ports_that_collide_fail_the_render(values: dict[str, Any]) -> None:
    with pytest.raises(Exception, match=r"sim\.kvEvents\.port and sim\.kvEvents\.replayPort must differ"):
        render(values)
