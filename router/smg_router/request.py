"""Parse a generation request once: its model, whether it streams, and its routing text.

The routing text is the whole prompt as the engine will see it: every chat message in order with its
role (not only the first), the completion prompt, or ``/generate``'s ``text`` / ``input_ids``.  Token
ids become one character each, so prefixes of token lists are prefixes of the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from smg_router.errors import BadRequest


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str | None
    stream: bool
    text: str
    body: dict[str, Any]


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


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
    except (TypeError, ValueError):
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


def parse_request(kind: str, raw: bytes) -> ParsedRequest:
    body = parse_body(raw)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("model must be a non-empty string", code="invalid_field")
    return ParsedRequest(model=model, stream=body.get("stream") is True, text=TEXT_OF[kind](body), body=body)
