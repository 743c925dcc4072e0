"""The chart's ``router.pd.mode``: the router's ``SMG_PD_MODE`` and, with the simulated fleet, smg-sim's roles."""

from __future__ import annotations

import helm_python as helm
import pytest
from smg_router.settings import parse_settings
from support.helm_chart import render

SIM_PD = {"enabled": True, "pd": {"enabled": True}}


def _env(deployment: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def _args(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_pd_mode_defaults_to_sglang_and_its_sim_roles() -> None:
    r = render({"router": {"pd": {"enabled": True}}, "sim": SIM_PD})
    assert _env(r.get("Deployment", "smg-router"))["SMG_PD_MODE"] == "sglang"
    prefill = _args(r.get("Deployment", "smg-sim-prefill"))
    assert prefill[prefill.index("--role") + 1] == "prefill" and "--vllm-pd" not in prefill
    assert "SMG_PD_MODE" not in _env(render().get("Deployment", "smg-router"))


def test_vllm_mode_reaches_the_router_and_gives_the_sims_vllm_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    r = render({"router": {"pd": {"enabled": True, "mode": "vllm"}}, "sim": SIM_PD})
    env = _env(r.get("Deployment", "smg-router"))
    assert env["SMG_PD_MODE"] == "vllm"
    for name, value in env.items():  # what the router would parse from that environment
        if value is not None:
            monkeypatch.setenv(name, value)
    assert parse_settings([]).pd.mode == "vllm"
    for role in ("prefill", "decode"):
        args = _args(r.get("Deployment", f"smg-sim-{role}"))
        assert args[args.index("--vllm-pd") + 1] == role and "--role" not in args
    prefill = _args(r.get("Deployment", "smg-sim-prefill"))
    assert prefill[prefill.index("--bootstrap-port") + 1] == "8998"  # its KV side channel


def test_an_unknown_pd_mode_is_refused_by_the_schema() -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render({"router": {"pd": {"enabled": True, "mode": "nixl"}}})
    assert "mode" in str(err.value)
