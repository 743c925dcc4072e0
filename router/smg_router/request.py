"""The request path's one record: a generation request parsed once, from the handler to the answer.

Parsing reads the model, whether it streams, and the routing text: the whole prompt as the engine will
see it (every chat message in order with its role, not only the first; the completion prompt;
``/generate``'s ``text`` or ``input_ids``).  Token ids become one character each, so prefixes of token
lists are prefixes of the text.  The record satisfies ``policies.base.RouteRequest`` (``model``,
``text``), so policies read it without seeing HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from smg_router.errors import BadRequest
from smg_router.http_io import parse_json_object

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}
"""Request kind → the endpoint path it arrives on and is forwarded to."""
FORWARD_REQUEST_HEADERS = ("content-type", "authorization", "accept", "x-request-id", "traceparent")
"""Client headers the worker gets; without ``authorization`` when the router checks its own ``--api-key``."""


@dataclass(slots=True, kw_only=True)
class ProxyRequest:
    """One generation request.  Built by ``parse_request``; ``Proxy.handle`` fills ``model`` and ``started``."""

    endpoint: str
    """Metric label and upstream path: /v1/chat/completions, /v1/completions, /generate."""
    requested_model: str | None
    """The ``model`` field as the client sent it (None when absent)."""
    stream: bool
    text: str
    """The routing text (the whole prompt)."""
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


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise BadRequest("messages[].content must be a string or a list of content parts", code="invalid_field")


def _ids_text(ids: list[Any], field: str) -> str:
    try:
        return "".join(map(chr, ids))
    except (TypeError, ValueError, OverflowError):  # chr() overflows past a C int: 2**31 is a token id too
        if all(isinstance(i, int) for i in ids):
            return " ".join(map(str, ids))
        raise BadRequest(f"{field} must be a list of token ids", code="invalid_field") from None


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


def chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages is required and must be a non-empty list", code="missing_field")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a string role", code="invalid_field")
        parts.append(f"<|{m['role']}|>{_content_text(m.get('content'))}\n")
    return "".join(parts)


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


TEXT_OF = {"chat": chat_text, "completions": completion_text, "generate": generate_text}


def parse_request(kind: str, raw: bytes, headers: Mapping[str, str] | None = None,
                  forward: tuple[str, ...] = FORWARD_REQUEST_HEADERS) -> ProxyRequest:
    """Parse a ``chat``, ``completions`` or ``generate`` body; a 400 naming the field when it is wrong."""
    body = parse_json_object(raw)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("model must be a non-empty string", code="invalid_field")
    forwarded = {} if headers is None else {k: v for k in forward if (v := headers.get(k)) is not None}
    return ProxyRequest(endpoint=ENDPOINTS[kind], requested_model=model, stream=body.get("stream") is True,
                        text=TEXT_OF[kind](body), body=body, raw=raw, headers=forwarded)
