"""A request's way in: admission, the endpoint table, then the request path's one record, parsed once.

Admission comes before the body is read: the body must fit ``--max-payload-size`` (413), and the router
must have room, both in requests (``--max-concurrent-requests``) and in body bytes held at once
(``--max-inflight-bytes``).  Body bytes count as they arrive, never as a client declares them
(``wire.Budget``, kept by the server): a body whose bytes take the router past the limit is shed as they
arrive.  Over either, a 503 with ``Retry-After`` (``smg_requests_rejected_total{reason}``): memory stays
bounded whatever clients send, and clients that send slowly hold only what they sent.  The same count is
what a graceful shutdown waits for (``Admission.wait_idle``).

Parsing reads the model, whether it streams, and the routing text: the whole prompt as the engine will
see it (every chat message in order with its role, not only the first; the completion prompt;
``/generate``'s ``text`` or ``input_ids``).  Token ids become one character each, so prefixes of token
lists are prefixes of the text.  Requests in a cache namespace of their own (``cache_salt``, a LoRA
adapter, ``extra_key``: ``NAMESPACE_FIELDS``) get a marker before the prompt.  The record satisfies
``policies.base.RouteRequest`` (``model``, ``text``), so policies read it without seeing HTTP.

``ENDPOINT_TABLE`` lists every path the router forwards (chat, completions, generate and the pass-through
endpoints: Messages, Responses, embeddings, rerank, score, classify, tokenize, detokenize, audio): how each
finds its routing text, which fields it requires, and whether it routes by the model's policy or by load.
``parse_endpoint`` parses any JSON row the same way; ``parse_request`` is its form for the three original kinds.

Routing headers (``apply_routing_headers``, called by the proxy): a session key (``--routing-key-header``,
default ``x-smg-routing-key``) pins the request; ``x-smg-routing-tokens`` (comma-separated token ids from a
gateway in front that tokenized the prompt) replaces the prompt text as the routing text.  Neither depends on
the endpoint; neither is forwarded to the worker except the session key, which SGLang reads too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from smg_router import wire
from smg_router.errors import BadRequest, Overloaded, PayloadTooLarge, RequestTimeout
from smg_router.http_io import parse_json_object, read_body
from smg_router.metrics import Metrics
from smg_router.tree.blocks import namespace_of
from smg_router.upload import StreamedUpload

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}
"""Request kind → the endpoint path it arrives on and is forwarded to."""
KIND_OF = {path: kind for kind, path in ENDPOINTS.items()}
RETRY_AFTER_S = 1
FORWARD_REQUEST_HEADERS = ("content-type", "authorization", "accept", "x-request-id", "traceparent", "idempotency-key")
"""Client headers the worker gets; without ``authorization`` when the router checks its own ``--api-key``."""
ANTHROPIC_HEADERS = ("x-api-key", "anthropic-version", "anthropic-beta")
"""What /v1/messages forwards besides: Anthropic's key header (only when the router checks no key) and versions."""


@dataclass(slots=True, kw_only=True)
class ProxyRequest:
    """One forwarded request.  Built by ``parse_endpoint`` (or ``upload_request``); ``Proxy.handle`` fills
    ``model`` and ``started``."""

    endpoint: str
    """Metric label and upstream path: a key of ``ENDPOINT_TABLE`` (/v1/chat/completions, /v1/embeddings, ...)."""
    requested_model: str | None
    """The ``model`` field as the client sent it (None when absent)."""
    stream: bool
    text: str
    """The routing text: the whole prompt, after the cache namespace marker if it has one."""
    head: int
    """Length of the text's head: what every later turn of the same conversation repeats (a chat's messages
    up to its first user message), where placement looks (``policies.cache_aware``); 0 when the prompt has
    no such structure (completions, /generate)."""
    body: dict[str, Any]
    """The parsed body (PD mode adds the bootstrap fields to it)."""
    raw: bytes
    """The bytes the client sent, forwarded unchanged in regular mode."""
    headers: dict[str, str] = field(default_factory=dict)
    """The client headers forwarded to the worker."""
    model: str = ""
    """The model key the request routes by, resolved by the proxy ("" for a fleet of unknown model)."""
    started: float = 0.0
    """``time.perf_counter()`` when the proxy took the request (latency and TTFT metrics)."""
    client_gone: bool = False
    """Set by the relay when the client hung up mid-stream (counted as status 499)."""
    by_load: bool = False
    """Routed to the least-loaded worker of the model, not by its policy (the non-generative endpoints)."""
    upload: StreamedUpload | None = None
    """A multipart body streamed through (``raw`` is then only its head, read to find the model)."""
    routing_key: str | None = None
    """The session key that pins the request to a worker (``policies.sticky``): the routing key header's value,
    or a Responses call's ``previous_response_id``; None: the model's policy chooses."""
    worker_hint: str | None = None
    """Id of the worker that produced the ``previous_response_id`` (the worker its tag names), or None."""
    previous_response_id: str | None = None
    """A Responses call's ``previous_response_id`` as the client sent it, when the body forwarded carries the
    engine's own id instead (``response_ids``): the answer repeats it in the client's form."""
    tokens: list[int] | None = None
    """The token ids of the engine's prompt when the router knows them (``prompts.prompt_tokens``): what the
    indexes of the engines' KV events match."""
    namespace: str = ""
    """The namespace of the prompt's KV blocks on the engine (``kv_namespace``), with ``tokens``."""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise BadRequest("messages[].content must be a string or a list of content parts", code="invalid_field")


def _ids_text(ids: list[Any], field: str) -> str:
    if not all(type(i) is int for i in ids):  # true and false are no token ids, though Python counts them as ints
        raise BadRequest(f"{field} must be a list of token ids", code="invalid_field")
    try:
        return "".join(map(chr, ids))
    except (ValueError, OverflowError):  # negative, past Unicode, past a C int: still ids, routed by their digits
        return " ".join(map(str, ids))


def _prompt_text(prompt: Any, field: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):  # a batch: route by the whole batch, in order
            return "\n".join(prompt)
        if all(isinstance(p, int) for p in prompt):
            return _ids_text(prompt, field)
        if all(isinstance(p, list) for p in prompt):
            return "\n".join(_ids_text(p, field) for p in prompt)
    raise BadRequest(f"{field} must be a string, a list of strings or a list of token ids", code="invalid_field")


def chat_text_and_head(body: dict[str, Any]) -> tuple[str, int]:
    """The routing text of a chat and the length of its head: every message up to the first user message's
    end, which every later turn of the conversation repeats."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages is required and must be a non-empty list", code="missing_field")
    parts = []
    head = -1
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a string role", code="invalid_field")
        parts.append(f"<|{m['role']}|>{_content_text(m.get('content'))}\n")
        if head < 0 and m["role"] == "user":
            head = sum(map(len, parts))
    text = "".join(parts)
    return text, head if head >= 0 else len(text)


def completion_text(body: dict[str, Any]) -> str:
    if "prompt" not in body:
        raise BadRequest("prompt is required", code="missing_field")
    return _prompt_text(body["prompt"], "prompt")


def generate_text(body: dict[str, Any]) -> str:
    if body.get("text") is not None:
        return _prompt_text(body["text"], "text")
    if body.get("input_ids") is not None:
        return _prompt_text(body["input_ids"], "input_ids")
    raise BadRequest("text or input_ids is required", code="missing_field")


def _no_head(text_of: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], tuple[str, int]]:
    def text_and_head(body: dict[str, Any]) -> tuple[str, int]:
        return text_of(body), 0

    return text_and_head


TEXT_OF = {"chat": chat_text_and_head, "completions": _no_head(completion_text), "generate": _no_head(generate_text)}
"""Request kind -> (routing text, its head): the head is the part later requests of the same conversation
repeat (a chat's messages up to its first user message); 0 for a prompt without that structure."""
NAMESPACE_FIELDS = ("cache_salt", "lora_path", "lora_name", "extra_key")
"""Body fields that give a request a KV cache of its own on the engine (vLLM's ``cache_salt``, SGLang's
``lora_path`` and ``extra_key``, a LoRA adapter): requests that differ in them never share cached prefixes."""


def cache_namespace(body: dict[str, Any]) -> str:
    """The routing text's namespace marker ("" for none): ``\x00field=value;...\x00`` before the prompt, so
    two namespaces never match each other's prefixes in the tree, and a new one is placed on its own."""
    if body.keys().isdisjoint(NAMESPACE_FIELDS):
        return ""  # the usual request: one set operation, no field looked up one by one
    parts = [f"{k}={v!r}" for k in NAMESPACE_FIELDS if (v := body.get(k)) not in (None, "", [])]
    return f"\x00{';'.join(parts)}\x00" if parts else ""


def kv_namespace(body: dict[str, Any]) -> str:
    """The namespace an engine caches the request's blocks in, as its KV events name it (``tree.blocks.namespace_of``):
    the LoRA adapter (SGLang's ``lora_path``, a ``lora_name``) and the cache salt (vLLM's ``cache_salt``, SGLang's
    ``extra_key``)."""
    if body.keys().isdisjoint(NAMESPACE_FIELDS):
        return ""
    lora = next((v for k in ("lora_name", "lora_path") if isinstance(v := body.get(k), str) and v), None)
    salt = next((v for k in ("cache_salt", "extra_key") if isinstance(v := body.get(k), str) and v), None)
    return namespace_of(lora, salt)


def messages_text_and_head(body: dict[str, Any]) -> tuple[str, int]:
    """Anthropic Messages: the ``system`` prompt (a string or text blocks), then every message, as a chat."""
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise BadRequest("system must be a string or a list of text blocks", code="invalid_field")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages is required and must be a non-empty list", code="missing_field")
    prefix = [{"role": "system", "content": system}] if system else []
    return chat_text_and_head({"messages": prefix + messages})


def _item_text(item: dict[str, Any]) -> str:
    """An input item without a role (a function call or its output): its textual fields, in a fixed order."""
    return "".join(v for k in ("name", "arguments", "output", "text") if isinstance(v := item.get(k), str))


def responses_text_and_head(body: dict[str, Any]) -> tuple[str, int]:
    """OpenAI Responses: ``instructions`` as the system prompt, then ``input`` (a string or input items)."""
    if "input" not in body:
        raise BadRequest("input is required", code="missing_field")
    instructions, given = body.get("instructions"), body["input"]
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", code="invalid_field")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if not isinstance(item, dict):
                raise BadRequest("input must be a string or a list of input items (objects)", code="invalid_field")
            role = item.get("role")
            if isinstance(role, str):
                messages.append({"role": role, "content": item.get("content")})
            else:
                messages.append({"role": str(item.get("type", "item")), "content": _item_text(item)})
    else:
        raise BadRequest("input must be a string or a list of input items", code="invalid_field")
    if not messages:
        raise BadRequest("input must not be empty", code="invalid_field")
    return chat_text_and_head({"messages": messages})


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One data-plane path the router forwards to a worker of the request's model, to the same path."""

    path: str
    summary: str
    text_of: Callable[[dict[str, Any]], tuple[str, int]] | None = None
    """A generation endpoint's routing text and its head: routed by the model's policy.  None: by load (the
    least-loaded routable worker of the model), for endpoints whose cost does not depend on a cached prefix."""
    required: tuple[tuple[str, ...], ...] = ()
    """Groups of body fields: each group needs one of its fields present (else a 400 naming them)."""
    multipart: bool = False
    """A multipart/form-data upload, streamed through (``upload``); else a JSON object."""
    key_header: str | None = None
    """A header that may carry the ``--api-key`` instead of ``Authorization: Bearer`` (Anthropic's clients send
    ``x-api-key``); forwarded to the worker only when ``authorization`` is (the router checks no key)."""
    headers: tuple[str, ...] = ()
    """Client headers this endpoint forwards besides ``FORWARD_REQUEST_HEADERS``."""
    pd: bool = False
    """Served by prefill/decode dispatch in PD mode.  The others, in PD mode: by load among the decode workers
    when they route by load (they need no KV transfer); a 501 for generation endpoints PD does not cover."""

    @property
    def by_load(self) -> bool:
        return self.text_of is None


ENDPOINT_TABLE: dict[str, Endpoint] = {
    e.path: e
    for e in (
        Endpoint(path="/v1/chat/completions", summary="Chat completion", text_of=TEXT_OF["chat"], pd=True),
        Endpoint(path="/v1/completions", summary="Completion", text_of=TEXT_OF["completions"], pd=True),
        Endpoint(path="/generate", summary="SGLang generate", text_of=TEXT_OF["generate"], pd=True),
        Endpoint(
            path="/v1/messages",
            summary="Anthropic Messages",
            text_of=messages_text_and_head,
            key_header="x-api-key",
            headers=ANTHROPIC_HEADERS,
        ),
        Endpoint(path="/v1/responses", summary="OpenAI Responses (stateless)", text_of=responses_text_and_head),
        Endpoint(path="/v1/embeddings", summary="Embeddings", required=(("input",),)),
        Endpoint(path="/v1/rerank", summary="Rerank (Jina/Cohere shape)", required=(("query",), ("documents",))),
        Endpoint(path="/rerank", summary="Rerank (vLLM's path)", required=(("query",), ("documents",))),
        Endpoint(path="/v1/score", summary="Score (vLLM)"),
        Endpoint(path="/v1/classify", summary="Classify (vLLM)", required=(("input",),)),
        Endpoint(path="/v1/tokenize", summary="Tokenize (vLLM)", required=(("prompt", "messages"),)),
        Endpoint(path="/v1/detokenize", summary="Detokenize (vLLM)", required=(("tokens",),)),
        Endpoint(path="/v1/audio/transcriptions", summary="Audio transcription (multipart)", multipart=True),
    )
}
"""Every forwarded path: how its routing text is found and how it is routed (``handlers`` serves them all)."""
PD_ENDPOINTS = frozenset(path for path, e in ENDPOINT_TABLE.items() if e.pd)
"""The paths prefill/decode dispatch serves in PD mode."""


def parse_request(
    kind: str, raw: bytes, headers: Mapping[str, str] | None = None, forward: tuple[str, ...] = FORWARD_REQUEST_HEADERS
) -> ProxyRequest:
    """Parse a ``chat``, ``completions`` or ``generate`` body; a 400 naming the field when it is wrong."""
    return parse_endpoint(ENDPOINT_TABLE[ENDPOINTS[kind]], raw, headers, forward)


def _names(endpoint: Endpoint, forward: tuple[str, ...]) -> tuple[str, ...]:
    """The client headers to forward: ``forward``, then the endpoint's own, its key header only when the router
    checks no key of its own (``authorization`` is forwarded then)."""
    if not endpoint.headers:
        return forward
    keyless = "authorization" in forward
    return forward + tuple(h for h in endpoint.headers if keyless or h != endpoint.key_header)


def _model_field(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise BadRequest("model must be a non-empty string", code="invalid_field")
    return value


def parse_endpoint(
    endpoint: Endpoint,
    raw: bytes,
    headers: Mapping[str, str] | None = None,
    forward: tuple[str, ...] = FORWARD_REQUEST_HEADERS,
) -> ProxyRequest:
    """Parse the JSON body of any forwarded endpoint; a 400 naming the field when it is wrong."""
    body = parse_json_object(raw)
    model = _model_field(body.get("model"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):  # a worker may read 1 or "yes" as true: never guess
        raise BadRequest("stream must be true or false", code="invalid_field")
    for group in endpoint.required:
        if all(body.get(f) is None for f in group):
            raise BadRequest(f"{' or '.join(group)} is required", code="missing_field")
    forwarded = (
        {} if headers is None else {k: v for k in _names(endpoint, forward) if (v := headers.get(k)) is not None}
    )
    text, head, namespace = "", 0, ""
    if endpoint.text_of is not None:
        namespace = cache_namespace(body)
        text, head = endpoint.text_of(body)
    return ProxyRequest(
        endpoint=endpoint.path,
        requested_model=model,
        stream=stream is True,
        text=namespace + text,
        head=len(namespace) + head if head else 0,
        body=body,
        raw=raw,
        headers=forwarded,
        by_load=endpoint.by_load,
    )


def upload_request(
    endpoint: Endpoint, upload: StreamedUpload, headers: Mapping[str, str], forward: tuple[str, ...]
) -> ProxyRequest:
    """The record of a streamed multipart upload whose head has been read: model and stream from its fields."""
    fields = upload.fields
    stream = fields.get("stream", "false").strip().lower()
    if stream not in ("true", "false"):
        raise BadRequest("stream must be true or false", code="invalid_field")
    forwarded = {k: v for k in forward if (v := headers.get(k)) is not None}
    if (length := headers.get("content-length")) is not None:
        forwarded["content-length"] = length  # streamed as it came: the worker reads the length it announced
    return ProxyRequest(
        endpoint=endpoint.path,
        requested_model=_model_field(fields.get("model")),
        stream=stream == "true",
        text="",
        head=0,
        body={},
        raw=upload.head,
        headers=forwarded,
        by_load=True,
        upload=upload,
    )


ROUTING_TOKENS_HEADER = "x-smg-routing-tokens"
"""Token ids a gateway in front supplies for routing, instead of the prompt text: ``1,2,3`` (decimal,
non-negative, comma separated, spaces allowed around them)."""
MAX_ROUTING_TOKENS = 131072
"""Most ids the routing tokens header may carry (a 400 above): a long prompt, bounded.  The server's limit on
one header's size usually binds first (``server.MAX_HEADER``: 8190 bytes, ~1500 ids; a 431 above)."""
TOKEN_BASE = 0xF0000
"""Token ids become characters of Unicode's supplementary private use planes (U+F0000 ...), which no text
uses: a token prefix is a text prefix in the tree, and never matches a text prompt."""
_ONE_CHAR = 0x1F000
"""Ids below this are one char (U+F0000 ... U+10EFFF); larger ones two: a lead in U+10F000 ... U+10FFFF (ids'
high bits), then their low 17 bits.  The code is prefix-free, so prefixes of id lists stay prefixes."""
MAX_TOKEN_ID = 2**29 - 1
"""The largest id the two-char form holds (4096 leads x 2^17); vocabularies are under 2^20."""


def routing_tokens_text(value: str) -> str:
    """The routing text of a routing tokens header; a 400 naming the header when it is malformed or too long."""
    return tokens_text(routing_token_ids(value))


def tokens_text(ids: list[int]) -> str:
    """Token ids as routing text (``TOKEN_BASE``)."""
    chars = []
    for i in ids:
        if i < _ONE_CHAR:
            chars.append(chr(TOKEN_BASE + i))
        else:
            chars.append(chr(0x10F000 + (i >> 17)) + chr(TOKEN_BASE + (i & 0x1FFFF)))
    return "".join(chars)


def routing_token_ids(value: str) -> list[int]:
    """The ids of a routing tokens header; a 400 naming the header when it is malformed or too long."""
    parts = value.split(",")
    if len(parts) > MAX_ROUTING_TOKENS:
        raise BadRequest(
            f"{ROUTING_TOKENS_HEADER} carries {len(parts)} token ids, more than {MAX_ROUTING_TOKENS}",
            code="invalid_header",
        )
    ids = []
    for p in parts:
        p = p.strip()
        if not p.isascii() or not p.isdigit() or int(p) > MAX_TOKEN_ID:
            raise BadRequest(
                f"{ROUTING_TOKENS_HEADER} must be comma-separated token ids (integers 0 to {MAX_TOKEN_ID}), "
                f"got {p[:32]!r}",
                code="invalid_header",
            )
        ids.append(int(p))
    return ids


def apply_routing_headers(req: ProxyRequest, headers: Mapping[str, str], key_header: str) -> None:
    """Read the routing headers into ``req``: the session key (``key_header``; "" off), forwarded as it came,
    and the routing tokens, which replace the prompt text after its cache namespace marker."""
    if key_header and (key := headers.get(key_header)) is not None and key != "":
        req.routing_key = key
        req.headers[key_header] = key
    if (tokens := headers.get(ROUTING_TOKENS_HEADER)) is not None:
        ids = routing_token_ids(tokens)
        if not req.by_load:  # a by-load endpoint has no routing text to replace (still checked: a 400 is a 400)
            namespace = cache_namespace(req.body)
            req.text = namespace + tokens_text(ids)
            req.head = 0  # ids carry no conversation structure the router can see
            req.tokens, req.namespace = ids, kv_namespace(req.body)


class Admission:
    """Admits generation requests before their body is read, and counts them until their answer is over.  Their
    body bytes are counted by the server as they arrive, in ``budget`` (``wire.Budget``), which admission reads."""

    __slots__ = ("_count", "_idle", "_metrics", "budget", "max_body", "max_requests")

    def __init__(self, *, max_requests: int, budget: wire.Budget, max_body: int, metrics: Metrics) -> None:
        self.max_requests = max_requests
        self.budget = budget
        self.max_body = max_body
        self._metrics = metrics
        self._count = 0
        self._idle: asyncio.Event | None = None  # made on first use, inside the running loop

    def __len__(self) -> int:
        return self._count

    async def enter(self, request: wire.Request) -> bytes:
        """Admit the request and read its body; ``leave()`` when its answer is over."""
        self.admit(request.content_length)
        try:
            return await read_body(request, self.max_body)
        except (PayloadTooLarge, RequestTimeout, Overloaded) as e:
            self.leave()
            self.refused(e)
            raise
        except BaseException:
            self.leave()
            raise

    def enter_streaming(self, request: wire.Request) -> None:
        """Admit a body streamed through (what it keeps, its head, and what waits to be passed on count as they
        arrive); ``leave()`` when its answer is over.  Its whole length still has to fit ``--max-payload-size``."""
        self.admit(request.content_length)

    def admit(self, size: int | None) -> None:
        """Admit a request whose body is ``size`` bytes (None: not said), or raise the 413 or the 503 and count it;
        ``leave()`` when its answer is over."""
        if size is not None and size > self.max_body:
            self.rejected("payload_too_large")
            raise PayloadTooLarge(
                f"request body of {size} bytes exceeds the limit of {self.max_body} bytes", code="payload_too_large"
            )
        if self._count >= self.max_requests or self.budget.full():
            reason = "concurrency" if self._count >= self.max_requests else "inflight_bytes"
            self.rejected(reason)
            raise Overloaded(
                f"the router is at its limit ({self._count} requests, {self.budget.held} body bytes in "
                "flight); retry shortly",
                code="overloaded",
                retry_after=RETRY_AFTER_S,
            )
        self._count += 1
        if self._idle is not None:
            self._idle.clear()

    def leave(self) -> None:
        self._count -= 1
        if self._count == 0 and self._idle is not None:
            self._idle.set()

    def rejected(self, reason: str) -> None:
        """Count a refusal (``smg_requests_rejected_total{reason}``)."""
        self._metrics.requests_rejected.labels(reason).inc()

    def refused(self, e: PayloadTooLarge | RequestTimeout | Overloaded) -> None:
        """Count a body refused while it was read: too large (413), stalled or too slow (408), shed over the body
        budget as it arrived (503)."""
        if isinstance(e, PayloadTooLarge):
            self.rejected("payload_too_large")
        else:
            self.rejected(e.reason if isinstance(e, RequestTimeout) else "inflight_bytes")

    async def wait_idle(self, seconds: float) -> bool:
        """Whether every admitted request finished within ``seconds``."""
        if self._count == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._idle.wait()
        return self._count == 0
