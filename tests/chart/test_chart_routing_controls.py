"""The chart's ``router.routingKeyHeader`` and ``router.modelAliases``: the router's environment, as it parses it."""

from __future__ import annotations

import helm_python as helm
import pytest
from smg_router.settings import parse_settings
from support.helm_chart import render


def _env(deployment: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def _parsed(values: dict, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for name, value in _env(render(values).get("Deployment", "smg-router")).items():
        if value is not None:
            monkeypatch.setenv(name, value)
    return parse_settings([]).routing


def test_defaults_keep_session_keys_on_and_no_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(render().get("Deployment", "smg-router"))
    assert env["SMG_ROUTING_KEY_HEADER"] == "x-smg-routing-key" and "SMG_MODEL_ALIAS" not in env
    assert _parsed({}, monkeypatch).model_aliases == ()


def test_aliases_and_the_key_header_reach_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    routing = _parsed(
        {"router": {"routingKeyHeader": "X-Session", "modelAliases": {"gpt-4o": "llama-3", "chat": "gpt-4o"}}},
        monkeypatch,
    )
    assert routing.key_header == "x-session"
    assert dict(routing.model_aliases) == {"gpt-4o": "llama-3", "chat": "llama-3"}


def test_an_empty_key_header_turns_session_keys_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parsed({"router": {"routingKeyHeader": ""}}, monkeypatch).key_header == ""


@pytest.mark.parametrize("values", [{"modelAliases": {"a,b": "c"}}, {"routingKeyHeader": "bad header"}])
def test_values_the_router_could_not_parse_are_refused_by_the_schema(values: dict) -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"router": values})
