"""The non-generative endpoints: embeddings, rerank, score, classify, tokenize/detokenize and chat and completion
render (vLLM shapes), audio.

None of them runs through the engine's batch (a real engine's pooling pass is short next to generation);
each answers from the text alone, deterministically.  An embedding is a hashed bag of words, normalised, so
texts that share words have close vectors and rerank scores mean something: a relevance score is the cosine
of the query's and the document's vectors, mapped to [0, 1].  A transcription is pseudo-text seeded from the
uploaded bytes.  Fault injection (``--error-rate``, ``--hang-rate``, ``--crash-after``) applies as on
generation, so a router's retries can be exercised on these paths too.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import re
import struct
import time
import uuid
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from . import generation as gen
from .errors import ApiError, json_response
from .openai_api import chat_prompt
from .state import STATE_KEY
from .tokens import decode, encode, prompt_seed, pseudo_text, token_str

DIMENSIONS = 64
"""Length of every embedding vector."""
_WORD = re.compile(r"\w+")


def embed(text: str, dimensions: int = DIMENSIONS) -> list[float]:
    """A unit vector from the words of ``text`` (each word adds ±1 at a dimension its hash picks)."""
    vector = [0.0] * dimensions
    for word in _WORD.findall(text.lower()):
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        index = int.from_bytes(digest[:4], "little") % dimensions
        vector[index] += 1.0 if digest[4] & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0.0:  # no words: a fixed unit vector, so every answer is a valid embedding
        return [1.0] + [0.0] * (dimensions - 1)
    return [v / norm for v in vector]


def relevance(query: str, document: str) -> float:
    """Cosine of the two texts' embeddings, from [-1, 1] to [0, 1]."""
    cosine = sum(a * b for a, b in zip(embed(query), embed(document), strict=True))
    return round((cosine + 1.0) / 2.0, 6)


def _inputs(value: Any) -> list[str]:
    """Embedding inputs: a string, strings, token ids or lists of token ids, as texts."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(type(v) is int and v >= 0 for v in value):
            return [decode(value)]
        if all(isinstance(v, list) and all(type(t) is int and t >= 0 for t in v) for v in value):
            return [decode(v) for v in value]
    raise ApiError(400, "input must be a string, a list of strings, or token ids")


async def embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings (OpenAI shape; ``encoding_format`` float or base64, as the openai client asks)."""
    state, body = await gen.admit(request)
    texts = _inputs(body.get("input"))
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be float or base64, got {encoding!r}")
    dimensions = body.get("dimensions") or DIMENSIONS
    if type(dimensions) is not int or not 0 < dimensions <= 4096:
        raise ApiError(400, "dimensions must be an integer between 1 and 4096")
    data = []
    for i, text in enumerate(texts):
        vector = embed(text, dimensions)
        value: Any = vector
        if encoding == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(encode(t)) for t in texts)
    return json_response(
        {
            "object": "list",
            "data": data,
            "model": state.config.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def rerank(request: web.Request) -> web.Response:
    """POST /v1/rerank and /rerank (vLLM's Jina-compatible shape): results by relevance, best first."""
    state, body = await gen.admit(request)
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str):
        raise ApiError(400, "query must be a string")
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        raise ApiError(400, "documents must be a list of strings")
    top_n = body.get("top_n")
    if top_n is not None and (type(top_n) is not int or top_n < 0):
        raise ApiError(400, "top_n must be a non-negative integer")
    scores = [relevance(query, d) for d in documents]
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]
    if top_n:
        results = results[:top_n]
    tokens = len(encode(query)) * len(documents) + sum(len(encode(d)) for d in documents)
    return json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": state.config.model,
            "usage": {"total_tokens": tokens},
            "results": results,
        }
    )


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ApiError(400, f"{name} must be a string or a non-empty list of strings")


async def score(request: web.Request) -> web.Response:
    """POST /v1/score (vLLM shape): ``text_1`` against each of ``text_2`` (one to one when both are lists)."""
    state, body = await gen.admit(request)
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} entries and text_2 {len(second)}: one, or as many")
    data = [
        {"index": i, "object": "score", "score": relevance(a, b)}
        for i, (a, b) in enumerate(zip(first, second, strict=True))
    ]
    tokens = sum(len(encode(a)) + len(encode(b)) for a, b in zip(first, second, strict=True))
    return json_response(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.config.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


LABELS = ("negative", "positive")


async def classify(request: web.Request) -> web.Response:
    """POST /v1/classify (vLLM shape): a label per input, from the sign of its embedding's first component."""
    state, body = await gen.admit(request)
    texts = _texts(body.get("input"), "input")
    data = []
    for i, text in enumerate(texts):
        p = round((embed(text)[0] + 1.0) / 2.0, 6)
        probs = [1.0 - p, p]
        data.append({"index": i, "label": LABELS[p >= 0.5], "probs": probs, "num_classes": len(LABELS)})
    tokens = sum(len(encode(t)) for t in texts)
    return json_response(
        {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.config.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    """POST /v1/tokenize (vLLM shape): ``prompt``, or ``messages`` through the chat template."""
    state, body = await gen.admit(request)
    if body.get("messages") is not None:
        text = chat_prompt(body["messages"])
        if body.get("add_generation_prompt") is False:
            text = text.removesuffix("<|assistant|>\n")
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise ApiError(400, "prompt (a string) or messages is required")
    tokens = encode(text)
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": state.config.kv_capacity, "tokens": tokens}
    answer["token_strs"] = [token_str(t) for t in tokens] if body.get("return_token_strs") else None
    return json_response(answer)


async def chat_render(request: web.Request) -> web.Response:
    """POST /v1/chat/completions/render (vLLM shape): the chat template applied and tokenized, answered as the
    generate request an engine would run (``request_id``, ``token_ids``, ``sampling_params``); nothing runs and
    nothing is cached.  vLLM's own router asks it before a cache-aware choice."""
    state, body = await gen.admit(request)
    if not isinstance(body.get("messages"), list):
        raise ApiError(400, "messages (a list) is required")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = gen.parse_max_tokens(limit, name="max_tokens", default=state.config.max_tokens_default, minimum=1)
    sampling = {"max_tokens": max_tokens, "temperature": body.get("temperature", 1.0), "stop": body.get("stop") or []}
    return json_response(
        {
            "request_id": "chatcmpl-" + uuid.uuid4().hex,
            "token_ids": encode(chat_prompt(body["messages"])),
            "features": None,
            "sampling_params": sampling,
        }
    )


async def completions_render(request: web.Request) -> web.Response:
    """POST /v1/completions/render (vLLM shape): each prompt (a string or a list of them) tokenized, answered as the
    list of generate requests an engine would run; nothing runs and nothing is cached.  vLLM's own router asks it
    before a cache-aware or KV-aware choice of a completion."""
    state, body = await gen.admit(request)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "prompt (a string or a non-empty list of strings) is required")
    max_tokens = gen.parse_max_tokens(
        body.get("max_tokens"), name="max_tokens", default=state.config.max_tokens_default, minimum=1
    )
    sampling = {"max_tokens": max_tokens, "temperature": body.get("temperature", 1.0), "stop": body.get("stop") or []}
    return json_response(
        [
            {
                "request_id": "cmpl-" + uuid.uuid4().hex,
                "token_ids": encode(p),
                "features": None,
                "sampling_params": sampling,
                "model": state.config.model,
            }
            for p in prompts
        ]
    )


async def detokenize(request: web.Request) -> web.Response:
    """POST /v1/detokenize (vLLM shape)."""
    _, body = await gen.admit(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t <= 0x10FFFF for t in tokens):
        raise ApiError(400, "tokens must be a list of token ids")
    return json_response({"prompt": decode(tokens)})


async def _form(request: web.Request) -> tuple[dict[str, str], bytes | None]:
    fields: dict[str, str] = {}
    audio: bytes | None = None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):  # a nested multipart: not a form field
            raise ApiError(400, "nested multipart parts are not accepted")
        if part.name in fields or (part.name == "file" and audio is not None):
            raise ApiError(400, f"form field {part.name!r} given more than once")  # one value each, as a schema says
        if part.name == "file":
            audio = await part.read()
        elif part.name:
            fields[part.name] = await part.text()
    return fields, audio


async def transcriptions(request: web.Request) -> web.Response:
    """POST /v1/audio/transcriptions (multipart): ``model`` and ``file``; the text is seeded from the bytes."""
    state = request.app[STATE_KEY]
    await gen.apply_fault(state)
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "this endpoint takes multipart/form-data")
    try:
        fields, audio = await _form(request)
    except (ValueError, HttpProcessingError) as exc:  # aiohttp's multipart reader on a malformed body
        raise ApiError(400, f"malformed multipart body: {exc}") from None
    if audio is None:
        raise ApiError(400, "file is required")
    if "model" not in fields:  # required by OpenAI's API; the router cannot check a field after the file
        raise ApiError(400, "model is required")
    model = fields["model"]
    if model != state.config.model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist (this worker serves `{state.config.model}`)",
            code="model_not_found",
        )
    seed = prompt_seed(list(hashlib.blake2b(audio, digest_size=16).digest()))
    words = "".join(itertools.islice(pseudo_text(seed), 48)).strip()
    answer: dict[str, Any] = {"text": words}
    if fields.get("response_format") == "verbose_json":
        answer |= {"task": "transcribe", "language": "en", "duration": len(audio) / 32000, "segments": []}
    answer["x_smg_sim"] = {"bytes": len(audio), "received_at": time.time()}
    return json_response(answer)
