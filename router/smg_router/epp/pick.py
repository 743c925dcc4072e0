"""One request's endpoints, chosen by the router's own routing core: what the Endpoint Picker answers a gateway.

The request is parsed as the HTTP path parses it (``request.parse_endpoint``: model, routing text), prepared as the
proxy prepares it (``Proxy.prepare``: the model key, aliases, the routing headers, the tokens of ``--tokenizer``),
admitted by the same ``Admission`` and routed by the same ``Attempts``, so the model's policy, its cache index, the
load view, the breakers and the metrics are the HTTP path's own.  The attempt's guard opens here and is closed by
the stream (``stream``) when the gateway's request is over.

The endpoints: the chosen worker's ``ip:port`` first, then up to ``--epp-fallbacks`` other routable workers of the
model, least loaded first (where a gateway that retries goes next).  A subset hint leaves out every worker it does
not name, before the policy chooses.  A path the router does not forward (``request.ENDPOINT_TABLE``) or a multipart
upload is routed by load among the workers of the one model the router serves (no body is read for its model).

What it does not do: prefill/decode dispatch (a 501: the gateway would need to send each request to two workers),
wait for a burst's first prefill (``coordination.Holds``: the gateway sends at once), retry (the gateway does).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

from smg_router.attempt import AttemptGuard
from smg_router.errors import NotSupported, NoWorkerAvailable
from smg_router.metrics import Metrics
from smg_router.proxy import Proxy
from smg_router.request import ENDPOINT_TABLE, Admission, ProxyRequest, parse_endpoint
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker

ROLE = "regular"
OTHER = "other"
"""The endpoint label (``smg_requests_total``) of a path the router does not forward."""


@lru_cache(maxsize=4096)  # a few URLs, asked twice per request: ``urlsplit`` is not cheap
def endpoint_of(url: str) -> str:
    """A worker URL's endpoint as gateways write it: ``http://10.0.0.5:8000`` → ``10.0.0.5:8000`` (IPv6 in
    brackets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True, kw_only=True)
class Pick:
    """A request's endpoints, and the attempt the chosen one's guard counts."""

    req: ProxyRequest
    guard: AttemptGuard
    endpoints: list[str]
    """The chosen worker's endpoint, then the fallbacks'."""
    fallbacks: dict[str, Worker] = field(default_factory=dict)
    """Endpoint → worker of each fallback."""

    @property
    def value(self) -> str:
        """The value of ``x-gateway-destination-endpoint`` and of its ``envoy.lb`` metadata: ``ip:port,ip:port``."""
        return ",".join(self.endpoints)


class Picker:
    """Chooses the endpoints of one request; ``admit`` before, ``leave`` once its stream is over."""

    def __init__(
        self,
        *,
        proxy: Proxy,
        admission: Admission,
        registry: WorkerRegistry,
        loads: LoadView,
        metrics: Metrics,
        forward_headers: tuple[str, ...],
        fallbacks: int,
    ) -> None:
        self._proxy = proxy
        self._admission = admission
        self._registry = registry
        self._loads = loads
        self.metrics = metrics
        self._forward = forward_headers
        self._fallbacks = fallbacks
        self.max_body = admission.max_body
        """The router's body cap (``--max-payload-size``): a longer request body is a 413."""

    def admit(self, size: int | None) -> None:
        """Admit one request (413 over the body cap, 503 over the router's limits: the stream answers a 429)."""
        self._admission.admit(size)

    def leave(self) -> None:
        self._admission.leave()

    def pick(
        self, *, path: str, headers: Mapping[str, str], body: bytes | None, subset: Collection[str] | None
    ) -> Pick:
        """The endpoints of the request, its guard open; a ``RouterError`` (400, 404, 501, 503) when there are none.
        ``body`` None: the gateway does not send bodies (routed as a path the router does not forward)."""
        if self._proxy.pd_mode:
            raise NotSupported(
                "the endpoint picker does not serve prefill/decode disaggregation: each request would need a prefill "
                "and a decode worker; run the router as the gateway's backend instead (docs/epp.md)",
                code="not_supported_in_pd_mode",
            )
        endpoint = ENDPOINT_TABLE.get(path.partition("?")[0])
        if endpoint is None or endpoint.multipart or body is None:
            req = ProxyRequest(
                endpoint=OTHER if endpoint is None else endpoint.path,  # a metric label: never the client's path
                requested_model=None,
                stream=False,
                text="",
                head=0,
                body={},
                raw=body or b"",
                by_load=True,
            )
        else:
            req = parse_endpoint(endpoint, body, headers, self._forward)
        self._proxy.prepare(req, headers)
        req.started = time.perf_counter()
        exclude: list[str] = []
        if subset is not None:
            allowed = frozenset(subset)
            exclude = [w.id for w in self._registry.serving(ROLE, req.model) if endpoint_of(w.url) not in allowed]
            if not allowed:
                raise NoWorkerAvailable("the subset hint names no endpoint", code="empty_subset")
        attempts = self._proxy.attempts
        try:
            guard = attempts.open(ROLE, req, exclude, by_load=req.by_load)
        except NoWorkerAvailable as e:
            if subset is not None:
                raise NoWorkerAvailable(f"{e.message} among the endpoints of the subset hint", code=e.code) from None
            raise
        pick = Pick(req=req, guard=guard, endpoints=[endpoint_of(guard.worker.url)])
        if self._fallbacks:
            others, _ = attempts.routable(ROLE, req.model, [*exclude, guard.worker.id])
            now = time.monotonic()
            effective = self._loads.effective
            others.sort(key=lambda w: (effective(w, now)[0], w.inflight))
            for w in others[: self._fallbacks]:
                ep = endpoint_of(w.url)
                if ep not in pick.fallbacks and ep != pick.endpoints[0]:
                    pick.fallbacks[ep] = w
                    pick.endpoints.append(ep)
        return pick

    def served_by(self, pick: Pick, endpoint: str) -> tuple[str, Worker | None]:
        """Which worker the gateway says served ``pick`` (its kind for ``smg_epp_served_total``): the chosen one, a
        fallback, another worker of the model, or none the router knows."""
        if endpoint == pick.endpoints[0]:
            return "primary", pick.guard.worker
        if (w := pick.fallbacks.get(endpoint)) is not None:
            return "fallback", w
        for w in self._registry.serving(ROLE, pick.req.model):
            if endpoint_of(w.url) == endpoint:
                return "elsewhere", w
        return "unreported", None

    def moved(self, pick: Pick, worker: Worker) -> None:
        """The request was served by ``worker``, not the chosen one: the attempt's accounting follows it (the chosen
        one's in-flight and processed counts given back; its breaker learns nothing)."""
        old = pick.guard
        old.worker.processed -= 1
        old.close()
        pick.guard = AttemptGuard(
            worker, registry=self._registry, metrics=self.metrics, prefill_chars=old.prefill_chars
        )
