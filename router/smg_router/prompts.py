"""The token ids of the prompt an engine will run for a request: what an index of its KV events is matched on.

Engines say what they cache in token ids, so the router needs the request's own: from a gateway in front
(the ``x-smg-routing-tokens`` header, ``request.apply_routing_headers``), else from the model's tokenizer (``--tokenizer
MODEL=PATH``: a directory with the HuggingFace ``tokenizer.json`` and, for chats, the ``chat_template`` of its
``tokenizer_config.json``, rendered with Jinja as the engines render it), else from ``/generate``'s own
``input_ids``.  Without any of them the request has no tokens, and its model's workers are matched by the router's
approximate tree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or a chat its template cannot render."""


def _raise(message: str) -> None:
    raise TokenizerError(message)


class Tokenizer:
    """One model's tokenizer and chat template, as its engines use them."""

    def __init__(self, path: Path) -> None:
        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises its own exception types
            raise TokenizerError(f"{file}: not a tokenizer.json: {e}") from None
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{config_file}: {e}") from None
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        template = config.get("chat_template")
        self._template: jinja2.Template | None = None
        if isinstance(template, str):
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"{config_file}: chat_template: {e}") from None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """The ids of ``text`` (with the tokenizer's special tokens, as a completion's prompt gets them)."""
        return list(self._tok.encode(text, add_special_tokens=special).ids)

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of a chat as the engine's template renders it, ready for the assistant's answer."""
        if self._template is None:
            raise TokenizerError("the tokenizer has no chat_template")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, **self._special)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat_template: {e}") from None
        return self.encode(text, special=False)  # the template wrote the special tokens it wants


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # an AddedToken written out
        value = value.get("content")
    return value if isinstance(value, str) else ""


def prompt_tokens(kind: str, body: Mapping[str, Any], tokenizer: Tokenizer | None) -> list[int] | None:
    """The engine prompt's ids of a request of ``kind`` (``chat``, ``completions``, ``generate``), or None when
    they cannot be known (no tokenizer, a batch of prompts, a template that fails: the request is still served)."""
    if kind == "generate":
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
            return ids
        prompt = body.get("text")
    elif kind == "completions":
        prompt = body.get("prompt")
    else:
        prompt = None
    if tokenizer is None:
        return None
    try:
        if kind == "chat":
            messages = body.get("messages")
            return tokenizer.chat(messages) if isinstance(messages, list) else None
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
    except TokenizerError:
        return None
    return None
