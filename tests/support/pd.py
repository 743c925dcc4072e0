"""PD fleets for integration tests: prefill sims with their own bootstrap ports, registration helpers."""

from __future__ import annotations

from pathlib import Path

from support.procs import MODEL, Router, Sim, free_port, next_host, start_sim


def start_prefill(logs: Path, **kw) -> tuple[Sim, int]:
    host = next_host()
    bport = free_port(host)
    extra = ["--role", "prefill", "--bootstrap-port", str(bport), *kw.pop("extra", [])]
    return start_sim(logs, host=host, extra=extra, **kw), bport


def start_decode(logs: Path, **kw) -> Sim:
    return start_sim(logs, extra=["--role", "decode", *kw.pop("extra", [])], **kw)


def register_pd(router: Router, prefills: list[tuple[Sim, int]], decodes: list[Sim]) -> None:
    for sim, bport in prefills:
        status, body = router.admin(
            "POST", "/workers", {"url": sim.url, "role": "prefill", "model_id": MODEL, "bootstrap_port": bport}
        )
        assert status == 201, body
    for sim in decodes:
        status, body = router.admin("POST", "/workers", {"url": sim.url, "role": "decode", "model_id": MODEL})
        assert status == 201, body
