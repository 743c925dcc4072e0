"""Pods as the operator's pure code sees them, and a port for an unreachable router, for the operator's unit tests."""

from __future__ import annotations

from typing import Any

from smg_operator.desired import PodInfo

from support.procs import free_port


def ready_pod(
    namespace: str, name: str, labels: dict[str, str], *, ip: str | None = "127.0.0.1", **changes: Any
) -> PodInfo:
    """A running, ready pod at ``ip`` (uid ``uid-<name>``, no annotations); ``changes`` set any other field."""
    fields: dict[str, Any] = {
        "namespace": namespace,
        "name": name,
        "uid": f"uid-{name}",
        "labels": labels,
        "annotations": {},
        "ip": ip,
        "running": True,
        "ready": True,
        "terminating": False,
    }
    return PodInfo(**{**fields, **changes})


def closed_port() -> int:
    """A loopback port nothing listens on: calls to it are refused at once (an unreachable router replica)."""
    return free_port()
