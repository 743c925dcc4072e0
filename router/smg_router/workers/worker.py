"""The worker: what was registered (``WorkerSpec``) and what the router knows of it at run time."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from smg_router.workers.breaker import CircuitBreaker

ROLES = ("regular", "prefill", "decode")


class WorkerStatus(StrEnum):
    PENDING = "pending"
    READY = "ready"
    NOT_READY = "not_ready"
    DRAINING = "draining"
    FAILED = "failed"


class SpecError(ValueError):
    """A registration that cannot be accepted; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def normalize_url(raw: object) -> str:
    """Accept ``http(s)://host[:port][/]`` only; return it without a trailing slash."""
    if not isinstance(raw, str) or not raw:
        raise SpecError("url", "must be a non-empty string like http://10.0.0.5:8000")
    try:
        parts = urlsplit(raw.strip())
    except ValueError as e:  # "http://[" (an unclosed IPv6 bracket), a backslash or NFKC trick in the host
        raise SpecError("url", f"{raw!r} is not a valid URL ({e})") from None
    if parts.username is not None or parts.password is not None:  # it would show in /workers, metrics and logs
        raise SpecError("url", "must not carry credentials (user:password@); workers are called without them")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecError("url", f"{raw!r} is not an http(s) URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as e:
        raise SpecError("url", f"{raw!r} has an invalid port ({e})") from None
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise SpecError("url", f"{raw!r} must not carry a path, query or fragment")
    return f"{parts.scheme}://{parts.netloc}"


@functools.lru_cache(maxsize=4096)
def worker_id_for(url: str) -> str:
    """Stable id from the URL: the same URL always gets the same id (idempotent registration).  Cached: placement
    asks for it on every miss (``CacheAwarePolicy.tenant_cap``), where a sha1 per call showed in profiles."""
    return "w-" + hashlib.sha1(url.encode()).hexdigest()[:12]


ZMQ_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")
"""Where an engine publishes its KV events: ``tcp://HOST:PORT``, as vLLM and SGLang bind them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KvEventsSpec:
    """Where a worker's engine publishes what its KV cache stores and evicts (its KV events), and where it replays
    them; ``topic`` filters the stream (vLLM's ``topic``, "" for all)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @classmethod
    def from_json(cls, data: object) -> KvEventsSpec:
        if not isinstance(data, dict):
            raise SpecError("kv_events", 'must be an object: {"endpoint": "tcp://HOST:PORT", ...}')
        unknown = sorted(set(data) - {"endpoint", "replay_endpoint", "topic"})
        if unknown:
            raise SpecError(f"kv_events.{unknown[0]}", "unknown field (known: endpoint, replay_endpoint, topic)")
        endpoint = _zmq_endpoint(data.get("endpoint"), "kv_events.endpoint", required=True)
        assert endpoint is not None
        replay = _zmq_endpoint(data.get("replay_endpoint"), "kv_events.replay_endpoint", required=False)
        topic = "" if data.get("topic") is None else data["topic"]
        if not isinstance(topic, str):
            raise SpecError("kv_events.topic", "must be a string")
        return cls(endpoint=endpoint, replay_endpoint=replay, topic=topic)

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": self.topic}


def _zmq_endpoint(value: object, name: str, *, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or (m := ZMQ_ENDPOINT.fullmatch(value)) is None or not 0 < int(m[2]) < 65536:
        raise SpecError(name, f"must be tcp://HOST:PORT, not {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """What a person or the operator registered; compared for idempotent re-registration."""

    url: str
    role: str = "regular"
    model_id: str | None = None
    bootstrap_port: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    priority: int = 50
    owner: str = "user"
    kv_capacity_tokens: int | None = None
    """The engine's usable KV cache in tokens, as its operator knows it; caps the worker's tree share in place of
    what the engine reports (``CacheAwarePolicy.tenant_cap``).  None: the engine's report, if any."""
    kv_events: KvEventsSpec | None = None
    """Where its engine publishes its KV events; None: it publishes none (the router's tree stands in)."""

    @classmethod
    def from_json(cls, data: object, *, base: WorkerSpec | None = None) -> WorkerSpec:
        """Validate a registration body; ``base`` supplies defaults (PUT/PATCH). Raises SpecError."""
        if not isinstance(data, dict):
            raise SpecError("body", "must be a JSON object")
        known = {
            "url",
            "role",
            "model_id",
            "bootstrap_port",
            "labels",
            "priority",
            "owner",
            "kv_capacity_tokens",
            "kv_events",
        }
        unknown = sorted(set(data) - known - {"draining"})
        if unknown:
            raise SpecError(unknown[0], f"unknown field (known: {', '.join(sorted(known))})")
        cur: dict[str, Any] = (
            {}
            if base is None
            else {
                "url": base.url,
                "role": base.role,
                "model_id": base.model_id,
                "bootstrap_port": base.bootstrap_port,
                "labels": base.labels,
                "priority": base.priority,
                "owner": base.owner,
                "kv_capacity_tokens": base.kv_capacity_tokens,
                "kv_events": base.kv_events,
            }
        )
        cur.update({k: v for k, v in data.items() if k in known})
        url = normalize_url(cur.get("url"))
        # only null (or leaving a field out) means its default: false, 0, [] or "" are wrong values, not absent ones
        role = "regular" if cur.get("role") is None else cur["role"]
        if role not in ROLES:
            raise SpecError("role", f"must be one of {', '.join(ROLES)}, not {role!r}")
        model_id = cur.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise SpecError("model_id", "must be a non-empty string")
        bport = cur.get("bootstrap_port")
        if bport is not None and (not isinstance(bport, int) or isinstance(bport, bool) or not 0 < bport < 65536):
            raise SpecError("bootstrap_port", "must be an integer port between 1 and 65535")
        labels = {} if cur.get("labels") is None else cur["labels"]
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise SpecError("labels", "must be an object of string keys and string values")
        priority = cur.get("priority", 50)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise SpecError("priority", "must be an integer")
        owner = "user" if cur.get("owner") in (None, "") else cur["owner"]
        if not isinstance(owner, str):
            raise SpecError("owner", "must be a string")
        kv = cur.get("kv_capacity_tokens")
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1):
            raise SpecError("kv_capacity_tokens", "must be a positive integer (tokens)")
        events = cur.get("kv_events")
        if events is not None and not isinstance(events, KvEventsSpec):
            events = KvEventsSpec.from_json(events)
        return cls(
            url=url,
            role=role,
            model_id=model_id,
            bootstrap_port=bport,
            labels=dict(labels),
            priority=priority,
            owner=owner,
            kv_capacity_tokens=kv,
            kv_events=events,
        )


class Worker:
    """A registered worker and its run-time state.  The registry owns it; policies only read it."""

    __slots__ = (
        "breaker",
        "health_failures",
        "health_successes",
        "held",
        "id",
        "inflight",
        "joining",
        "prefill_chars",
        "prefilling",
        "processed",
        "prompt_tokens",
        "spec",
        "status",
    )

    def __init__(self, spec: WorkerSpec, breaker: CircuitBreaker) -> None:
        self.spec = spec
        self.id = worker_id_for(spec.url)
        self.status = WorkerStatus.PENDING
        self.breaker = breaker
        self.inflight = 0
        """Requests this router has in flight to the worker (the local count)."""
        self.prefilling = 0
        """Those of them whose answer has not started (no chunk of a stream yet; a whole answer until it ends): what
        the engine still prefills (engines prefill before they decode, so a prompt sent to a worker busy prefilling
        waits for it; how many requests it decodes says little of that)."""
        self.prefill_chars = 0
        """The chars those still have to prefill, as the policy expected when it chose (a prompt's uncached part)."""
        self.processed = 0
        """Requests this router has sent to the worker, for tie-breaks."""
        self.prompt_tokens = 0
        """The prompt tokens of its in-flight requests: counted when the router knows them, else their chars over
        ``--tree-chars-per-token`` (``Attempts.open``); what ``smg_model_prompt_tokens_inflight`` sums."""
        self.held: dict[str, int] = {}
        """Leading chars -> how many of its requests wait before being sent, behind the first prefill of those chars
        here (``coordination.Holds``): a burst that will find them cached, one prefill, not one each."""
        self.joining: dict[str, int] = {}
        """Leading chars -> how many of its streamed requests with them have not started their answer (held ones
        included): the engine prefills them together, so for a request with the same leading chars they are one."""
        self.health_failures = 0
        self.health_successes = 0

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def model_id(self) -> str | None:
        return self.spec.model_id

    @property
    def routable(self) -> bool:
        return self.status is WorkerStatus.READY and self.breaker.allows()

    def __repr__(self) -> str:
        return f"<Worker {self.id} {self.url} {self.role} {self.status.value}>"

    def to_json(self, backend_load: int | None = None) -> dict[str, Any]:
        s = self.spec
        return {
            "id": self.id,
            "url": s.url,
            "role": s.role,
            "model_id": s.model_id,
            "bootstrap_port": s.bootstrap_port,
            "labels": s.labels,
            "priority": s.priority,
            "owner": s.owner,
            "kv_capacity_tokens": s.kv_capacity_tokens,
            "kv_events": None if s.kv_events is None else s.kv_events.to_json(),
            "status": self.status.value,
            "routable": self.routable,
            "breaker": self.breaker.state.value,
            "load": {
                "inflight": self.inflight,
                "prefilling": self.prefilling,
                "prefill_chars": self.prefill_chars,
                "held": sum(self.held.values()),
                "backend": backend_load,
                "processed": self.processed,
            },
        }
