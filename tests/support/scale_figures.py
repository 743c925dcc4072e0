"""Figures of an operator scale run (``scale_fleet``): latencies from the routers' own logs, the operator's API
requests from the API server's audit log (``ControlPlane(audit=True)``), and the operator's router calls and CPU
from its metrics and ``/proc``.

Latencies are not polled: each router logs ``worker added: <url>`` and ``worker removed: <url>`` with a millisecond
timestamp when its registry changes (``smg_router.fleet.lifecycle``), and ``scale_fleet`` records the wall-clock time
the API server answered the pod's Ready patch or its DELETE.  Pod Ready -> registered on every replica is the latest
of the replicas' ``added`` times minus the Ready time; pod deleted -> gone from every replica likewise with
``removed``.  Both clocks are this machine's.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from support.procs import metric_value
from support.scale_fleet import PodRecord

_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: worker (added|removed): (\S+)")
HOOKS = ("list", "register", "update", "remove", "drain")
"""``smg_operator_hook_calls_total`` hooks, in table order (``list`` is ``GET /workers``)."""


@dataclass
class RouterTimes:
    added: list[float] = field(default_factory=list)
    removed: list[float] = field(default_factory=list)


def router_log_times(text: str) -> dict[str, RouterTimes]:
    """worker URL -> when the router added and removed it (local wall-clock times, as ``time.time()``)."""
    times: dict[str, RouterTimes] = {}
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if not m:
            continue
        stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        entry = times.setdefault(m.group(3), RouterTimes())
        (entry.added if m.group(2) == "added" else entry.removed).append(stamp)
    return times


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Latencies:
    ready_to_registered: list[float] = field(default_factory=list)
    """Seconds from a pod's Ready to its worker being on every replica, for the pods made Ready in the window."""
    not_registered: list[str] = field(default_factory=list)
    """Pods made Ready in the window that some replica never added while the pod lived (nor after)."""
    deleted_to_gone: list[float] = field(default_factory=list)
    """Seconds from a registered pod's deletion to its worker being gone from every replica."""
    not_removed: list[str] = field(default_factory=list)
    """Pods deleted in the window whose worker some replica added and never removed."""


SLACK = 0.005
"""The router's log stamps are truncated to milliseconds; ours are not."""


def latencies(
    pods: Iterable[PodRecord], routers: Mapping[str, Mapping[str, RouterTimes]], *, start: float, end: float
) -> Latencies:
    """Latencies of the pods made Ready, and of those deleted, between ``start`` and ``end`` (wall-clock)."""
    out = Latencies()
    for pod in pods:
        if pod.ready_at is not None and start <= pod.ready_at < end:
            firsts = [_first_after(r.get(pod.url), "added", pod.ready_at) for r in routers.values()]
            if all(t is not None for t in firsts):
                out.ready_to_registered.append(max(t for t in firsts if t is not None) - pod.ready_at)
            else:
                out.not_registered.append(pod.name)
        if pod.deleted_at is not None and start <= pod.deleted_at < end:
            held = [r[pod.url] for r in routers.values() if pod.url in r and r[pod.url].added]
            if not held:
                continue  # never registered anywhere: nothing to remove
            gone = [_first_after(t, "removed", pod.deleted_at) for t in held]
            if all(t is not None for t in gone):
                out.deleted_to_gone.append(max(t for t in gone if t is not None) - pod.deleted_at)
            else:
                out.not_removed.append(pod.name)
    return out


def _first_after(times: RouterTimes | None, kind: str, after: float) -> float | None:
    if times is None:
        return None
    later = [t for t in getattr(times, kind) if t >= after - SLACK]
    return max(min(later), after) if later else None


# -- the operator's API requests ---------------------------------------------------------------------------
def audit_requests(events: Iterable[Mapping[str, Any]], *, user: str, start: float, end: float) -> Counter[str]:
    """Requests ``user`` made that the API server received between ``start`` and ``end``, by ``verb resource``,
    from ``ControlPlane(audit=True).audit_events()`` (a watch counts once, however many stages it logged)."""
    seen: set[str] = set()
    counts: Counter[str] = Counter()
    for event in events:
        if event.get("user", {}).get("username") != user or event["auditID"] in seen:
            continue
        seen.add(event["auditID"])
        received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
        if not start <= received < end:
            continue
        ref = event.get("objectRef") or {}
        resource = ref.get("resource", event.get("requestURI", "?").split("?")[0])
        if ref.get("subresource"):
            resource += "/" + ref["subresource"]
        counts[f"{event['verb']} {resource}"] += 1
    return counts


# -- the operator's own counters and CPU -------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Snapshot:
    """The operator's counters and the CPU of the operator and the routers at one moment."""

    at: float
    hook_calls: dict[str, float]
    reconciles: float
    operator_cpu: float
    routers_cpu: float

    @staticmethod
    def take(*, at: float, metrics: str, operator_pid: int, router_pids: Iterable[int]) -> Snapshot:
        return Snapshot(
            at=at,
            hook_calls={h: metric_value(metrics, "smg_operator_hook_calls_total", hook=h) for h in HOOKS},
            reconciles=metric_value(metrics, "smg_operator_reconcile_total"),
            operator_cpu=cpu_seconds(operator_pid),
            routers_cpu=sum(cpu_seconds(p) for p in router_pids),
        )
