"""vLLM-style PD fleets for integration tests (``smg-sim --vllm-pd``): prefill sims with their own KV side
channels, decode sims, registration through the lifecycle API, and what the sims report about the legs."""

from __future__ import annotations

from pathlib import Path

from support.procs import MODEL, Router, Sim, free_port, http_json, metric_value, next_host, start_sim


def start_vllm_prefill(logs: Path, **kw) -> Sim:
    host = next_host()
    extra = ["--vllm-pd", "prefill", "--bootstrap-port", str(free_port(host)), *kw.pop("extra", [])]
    return start_sim(logs, host=host, extra=extra, **kw)


def start_vllm_decode(logs: Path, **kw) -> Sim:
    return start_sim(logs, extra=["--vllm-pd", "decode", "--bootstrap-timeout", "3", *kw.pop("extra", [])], **kw)


def register(router: Router, prefills: list[Sim], decodes: list[Sim]) -> None:
    for role, sims in (("prefill", prefills), ("decode", decodes)):
        for sim in sims:
            status, body = router.admin("POST", "/workers", {"url": sim.url, "role": role, "model_id": MODEL})
            assert status == 201, body


def generated_tokens(sim: Sim) -> float:
    """Tokens the sim generated so far (the prefill leg asks for one per request)."""
    return metric_value(http_json("GET", sim.url + "/metrics")[1] or "", "sglang:generation_tokens_total")


def requests_seen(sim: Sim) -> float:
    return metric_value(http_json("GET", sim.url + "/metrics")[1] or "", "sglang:num_requests_total")


def held_kv(sim: Sim) -> list[dict]:
    """The KV a prefill sim holds for decodes, from its side channel (its port: /get_server_info)."""
    port = http_json("GET", sim.url + "/get_server_info")[1]["disaggregation_bootstrap_port"]
    return http_json("GET", f"http://{sim.host}:{port}/kv/held")[1]["held"]
