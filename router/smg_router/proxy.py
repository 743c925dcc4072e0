"""THE request path: resolve the model → route and open an attempt → send → retry elsewhere → relay → count.

A request is routed by its model's policy among the routable workers (``attempt``), counted in the
chosen worker's in-flight total for as long as its response lasts (the attempt's guard), sent as the
bytes the client sent (never re-serialised), and answered with the worker's response, streamed through
as it arrives (``relay``).  A connect error, a timeout, a 5xx or a 429 before anything reached the client is
retried on another worker with backoff by the one retry loop (``retry``, whose docstring states the rule; a 429
with no other worker to try is passed on).  In PD mode the request goes to ``pd`` instead, which uses the same
attempts, retry loop and relay.

Before that, what the request says about its routing (``--model-alias``, ``request.apply_routing_headers``):
a model alias names the served model instead (its body re-serialised with the served name, only then); a
session key header, or a Responses call's ``previous_response_id`` (with the worker that produced it, which any
replica reads from the id's tag: ``response_ids``; the engine's own id is forwarded), pins it
(``policies.sticky``); routing tokens replace its routing text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import orjson

from smg_router import wire
from smg_router.attempt import Attempts
from smg_router.coordination import NO_PEERS, Holds, Peers
from smg_router.errors import (
    BadRequest,
    ModelNotFound,
    NotSupported,
    NoWorkerAvailable,
    PayloadTooLarge,
    RequestTimeout,
)
from smg_router.metrics import Metrics
from smg_router.pd import PDDispatcher, pd_dispatcher
from smg_router.policies.base import Policy
from smg_router.policies.registry import PolicyRegistry
from smg_router.prompts import Tokenizer, prompt_tokens
from smg_router.relay import RESPONSES, Relay
from smg_router.request import KIND_OF, PD_ENDPOINTS, ProxyRequest, apply_routing_headers, kv_namespace
from smg_router.response_ids import ResponseIdTags
from smg_router.retry import RetryLoop
from smg_router.settings import HoldSettings, RetrySettings, RoutingSettings
from smg_router.upstream import Upstream, UpstreamConnectError, UpstreamResponse
from smg_router.waiting import WaitingRoom
from smg_router.workers.declarations import Declarations
from smg_router.workers.registry import WorkerRegistry


class Proxy:
    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        policies: PolicyRegistry,
        upstream: Upstream,
        metrics: Metrics,
        retry: RetrySettings,
        pd_mode: str | None = None,
        by_load: Policy | None = None,
        routing: RoutingSettings | None = None,
        holds: Holds | None = None,
        peers: Peers = NO_PEERS,
        tokenizers: Mapping[str, Tokenizer] | None = None,
        hold: HoldSettings | None = None,
        declarations: Declarations | None = None,
        chars_per_token: float = 3.0,
    ) -> None:
        self._registry = registry
        self.declarations = declarations if declarations is not None else Declarations()
        """The models declared with or without workers (``PUT /models/{model}``): known, so held rather than 404."""
        self._tokenizers: Mapping[str, Tokenizer] = tokenizers or {}
        """Model -> its tokenizer (``--tokenizer``): the prompts whose token ids the router computes."""
        self._routing = routing or RoutingSettings()
        self.aliases: Mapping[str, str] = dict(self._routing.model_aliases)
        """Public model name → the served name it routes to (``--model-alias``); ``/v1/models`` lists them too."""
        self.response_ids = (
            ResponseIdTags(self._routing.response_id_key.encode())
            if self._routing.response_id_key
            else ResponseIdTags()
        )
        self._upstream = upstream
        self._metrics = metrics
        self._attempts = Attempts(
            registry=registry,
            policies=policies,
            metrics=metrics,
            by_load=by_load,
            holds=holds,
            peers=peers,
            max_ejection_share=retry.max_ejection_share,
            chars_per_token=chars_per_token,
        )
        self.waiting = WaitingRoom(
            settings=hold or HoldSettings(), metrics=metrics, routable=self._attempts.has_routable
        )
        """The requests for a known model with no routable worker (``--hold-when-empty``); the lifecycle wakes it."""
        self.holds = self._attempts.holds
        """The bursts waiting for their first prefill (``coordination.Holds``); the peers' leads go in too
        (``admin``)."""
        self._retries = RetryLoop(attempts=self._attempts, settings=retry, metrics=metrics)
        self.relay = Relay(
            metrics=metrics, response_ids=self.response_ids, expose_worker_url=self._routing.expose_worker_url
        )
        self._pd: PDDispatcher | None = None
        if pd_mode is not None:  # "sglang" or "vllm" (--pd-mode)
            self._pd = pd_dispatcher(
                pd_mode,
                attempts=self._attempts,
                upstream=upstream,
                relay=self.relay,
                metrics=metrics,
                retries=self._retries,
            )

    async def handle(self, request: wire.Request, req: ProxyRequest) -> wire.Response:
        """Answer one parsed generation request; errors raise ``RouterError`` for the error middleware."""
        self.prepare(req, request.headers)
        req.started = time.perf_counter()
        status = 500
        try:
            roles = self._roles(req)
            for role in roles:
                if not self._attempts.has_routable(role, req.model):
                    await self.waiting.hold(req.model, roles)  # no worker to route to: wait for one, or a 503
                    break
            if self._pd is None:
                response = await self._forward(request, req, "regular")
            elif req.endpoint in PD_ENDPOINTS:
                response = await self._pd.forward(request, req)
            elif req.by_load:  # no KV to hand over: a decode worker serves it whole
                response = await self._forward(request, req, "decode")
            else:
                raise NotSupported(
                    f"{req.endpoint} is not served in PD mode: prefill/decode dispatch covers "
                    f"{', '.join(sorted(PD_ENDPOINTS))}",
                    code="not_supported_in_pd_mode",
                )
            status = 499 if req.client_gone else response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        except Exception as e:
            status = getattr(e, "status", 500)  # RouterError and HTTPException carry theirs; for the metric only
            raise
        finally:
            m = self._metrics
            m.requests.labels(req.endpoint, req.model, str(status)).inc()
            m.request_seconds.labels(req.endpoint, req.model).observe(time.perf_counter() - req.started)

    def _roles(self, req: ProxyRequest) -> tuple[str, ...]:
        """The roles a request needs a routable worker of: regular; in PD mode prefill and decode, or decode alone for
        one routed by load (an endpoint PD mode does not split answers its 501 whatever the fleet)."""
        if self._pd is None:
            return ("regular",)
        if req.endpoint in PD_ENDPOINTS:
            return ("prefill", "decode")
        return ("decode",) if req.by_load else ()

    @property
    def attempts(self) -> Attempts:
        """Where every attempt is chosen and guarded (the Endpoint Picker picks through it too)."""
        return self._attempts

    @property
    def pd_mode(self) -> bool:
        """Whether requests go to prefill/decode dispatch."""
        return self._pd is not None

    def prepare(self, req: ProxyRequest, headers: Mapping[str, str]) -> None:
        """What a parsed request says about its routing, applied once, before its first attempt: the model key (404,
        503), a model alias (the body re-serialised), the routing headers, the prompt's tokens (``--tokenizer``), a
        Responses call's ``previous_response_id``.  ``handle`` and the Endpoint Picker (``epp``) both call it."""
        req.model = self.resolve_model(req.requested_model)
        self._apply_alias(req)
        apply_routing_headers(req, headers, self._routing.key_header)
        if req.tokens is None and (tokenizer := self._tokenizers.get(req.model)) is not None:
            kind = KIND_OF.get(req.endpoint)
            if kind is not None:
                req.tokens, req.namespace = prompt_tokens(kind, req.body, tokenizer), kv_namespace(req.body)
        if req.endpoint == RESPONSES and isinstance(prev := req.body.get("previous_response_id"), str) and prev:
            req.routing_key = prev  # the stored response is on one worker: before any session key
            self._untag_previous(req, prev)

    def resolve_model(self, requested: str | None) -> str:
        """The model key a request routes by: 404 for a model no worker serves and nobody declared, 503 with no
        workers and no declarations."""
        role = "decode" if self._pd is not None else "regular"
        models = self._registry.models_of(role)
        declared = self.declarations.models()
        if not models and not declared:
            raise NoWorkerAvailable(f"no {role} workers are registered", code="no_workers")
        if requested is not None:
            asked = requested
            if requested not in models and requested not in declared:  # a served name wins over an alias of the
                requested = self.aliases.get(requested, requested)  # same name (a worker added later)
            if requested in models or requested in declared:
                return requested
            if None in models:  # a worker whose model is not known yet may serve it: the shared "" key, so a
                return ""  # client-chosen name never creates a tree or a metric series of its own
            raise ModelNotFound(asked)
        known = sorted({m for m in models if m is not None} | declared)
        if len(known) == 1:
            return known[0]
        if not known:
            return ""
        raise BadRequest(f"model is required: this router serves {', '.join(known)}", code="missing_field")

    def _untag_previous(self, req: ProxyRequest, prev: str) -> None:
        """A tagged ``previous_response_id``: the worker its tag names is the hint, and the worker gets its own id
        (the body re-serialised, only then)."""
        engine_id, token = self.response_ids.untag(prev)
        if token is None:
            return  # not ours: routed by rendezvous of the id, forwarded as sent
        for w in self._registry.serving("regular", req.model):
            if self.response_ids.token(w.url) == token:
                req.worker_hint = w.id
                break
        req.previous_response_id = prev
        req.body["previous_response_id"] = engine_id
        req.raw = orjson.dumps(req.body)

    def _apply_alias(self, req: ProxyRequest) -> None:
        """A request for an alias: the body forwarded names the served model (re-serialised only then)."""
        public = req.requested_model
        served = self.aliases.get(public) if public is not None and public != req.model else None
        if served is None or (req.model and req.model != served):
            return  # no alias, or the name is served itself
        if req.upload is not None:
            raise BadRequest(
                f"model alias '{public}' cannot be applied to a multipart upload (the router streams it through "
                f"unchanged): send model '{served}'",
                code="alias_not_supported",
            )
        req.body["model"] = served
        req.raw = orjson.dumps(req.body)

    async def _forward(self, request: wire.Request, req: ProxyRequest, role: str) -> wire.Response:
        """Send the request to a worker of ``role`` (to another after a failure: ``retry``) and relay its answer."""
        return await self._retries.run(
            role,
            req,
            send=lambda guard: self._send(guard.worker.url + req.endpoint, req),
            use=lambda guard, upstream: self.relay.relay(request, req, upstream, guard),
            by_load=req.by_load,
            streamed=req.stream,
        )

    async def _send(self, url: str, req: ProxyRequest) -> UpstreamResponse:
        """POST the client's bytes, or stream its upload; a failed upload is the client's error, not the worker's."""
        if req.upload is None:
            return await self._upstream.post(url, req.raw, req.headers)
        try:
            return await self._upstream.post_stream(url, req.upload.body(), req.headers)
        except (PayloadTooLarge, RequestTimeout):
            raise
        except (UpstreamConnectError, TimeoutError):
            if req.upload.failure is not None:  # the worker's side broke because the client's upload failed
                raise req.upload.failure from None
            raise
