"""The endpoint table: routing text of Messages and Responses, by-load rows, and the multipart head scan."""

from __future__ import annotations

import json

import pytest
from smg_router.errors import BadRequest
from smg_router.request import ENDPOINT_TABLE, PD_ENDPOINTS, parse_endpoint, parse_request
from smg_router.upload import boundary_of, scan_head


def _parse(path: str, body: dict) -> object:
    return parse_endpoint(ENDPOINT_TABLE[path], json.dumps(body).encode())


def test_messages_route_by_the_system_prompt_and_the_conversation_as_a_chat_would() -> None:
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "U1"}, {"type": "image", "source": {}}]},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U2"},
    ]
    messages = _parse("/v1/messages", {"system": [{"type": "text", "text": "S"}], "messages": conversation})
    chat = parse_request("chat", json.dumps({"messages": [{"role": "system", "content": "S"}, *conversation]}).encode())
    assert messages.text == chat.text == "<|system|>S\n<|user|>U1\n<|assistant|>A\n<|user|>U2\n"
    assert messages.head == chat.head == len("<|system|>S\n<|user|>U1\n")
    assert not messages.by_load


def test_responses_route_by_instructions_and_input() -> None:
    plain = _parse("/v1/responses", {"instructions": "I", "input": "Q"})
    assert plain.text == "<|system|>I\n<|user|>Q\n" and plain.head == len(plain.text)
    items = _parse(
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
                {"type": "function_call", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "output": "42"},
            ]
        },
    )
    assert items.text == "<|user|>Q\n<|function_call|>f{}\n<|function_call_output|>42\n"


def test_a_cache_namespace_applies_to_the_generation_pass_throughs() -> None:
    salted = _parse("/v1/responses", {"input": "Q", "cache_salt": "s"})
    assert salted.text.startswith("\x00cache_salt='s'\x00")


@pytest.mark.parametrize(
    "path",
    ["/v1/embeddings", "/v1/rerank", "/rerank", "/v1/score", "/v1/classify", "/v1/tokenize", "/v1/detokenize"],
)
def test_non_generative_endpoints_route_by_load_with_no_routing_text(path: str) -> None:
    body = {"input": "x", "query": "q", "documents": ["d"], "prompt": "p", "tokens": [1]}
    req = _parse(path, body)
    assert req.by_load and req.text == "" and req.head == 0 and req.endpoint == path


def test_only_the_three_original_endpoints_go_through_pd_dispatch() -> None:
    assert {"/v1/chat/completions", "/v1/completions", "/generate"} == PD_ENDPOINTS


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/embeddings", {"input": None}, "input is required"),
        ("/v1/rerank", {"documents": []}, "query is required"),
        ("/v1/tokenize", {}, "prompt or messages is required"),
        ("/v1/messages", {"messages": []}, "messages is required"),
        ("/v1/messages", {"system": 1, "messages": [{"role": "user"}]}, "system must be"),
        ("/v1/responses", {"input": [1]}, "input items"),
        ("/v1/responses", {"input": [], "instructions": None}, "input must not be empty"),
        ("/v1/responses", {"input": "x", "instructions": 3}, "instructions must be a string"),
        ("/v1/score", {"stream": "yes"}, "stream must be true or false"),
    ],
)
def test_bad_bodies_are_400s_naming_the_problem(path: str, body: dict, words: str) -> None:
    with pytest.raises(BadRequest) as e:
        _parse(path, body)
    assert words in e.value.message


B = b"XyZ"


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    extra = f'; filename="{filename}"' if filename else ""
    return b"--" + B + f'\r\nContent-Disposition: form-data; name="{name}"{extra}\r\n\r\n'.encode() + value + b"\r\n"


def test_the_head_scan_finds_the_fields_before_the_file_however_the_bytes_arrive() -> None:
    form = _part("model", b"whisper") + _part("stream", b"true") + _part("file", b"\x00" * 50, "a.wav")
    form += b"--" + B + b"--\r\n"
    complete_at = form.index(b'name="file"') + 40
    for cut in range(len(form) + 1):
        fields, done = scan_head(form[:cut], B)
        if done:
            assert fields == {"model": "whisper", "stream": "true"}
            assert cut >= form.index(b"\r\n\r\n", form.index(b'name="file"'))  # only once the file's headers are in
        else:
            assert cut < complete_at
    assert scan_head(form, B) == ({"model": "whisper", "stream": "true"}, True)


def test_a_file_first_form_has_no_fields_and_a_form_without_file_ends_at_its_close() -> None:
    assert scan_head(_part("file", b"abc", "a.wav") + _part("model", b"m"), B) == ({}, True)
    assert scan_head(_part("model", b"m") + b"--" + B + b"--\r\n", B) == ({"model": "m"}, True)
    # filename= is not name=: the field of a part is its name only
    assert scan_head(_part("model", b"m") + _part("upload", b"x", "model"), B) == ({"model": "m"}, True)


@pytest.mark.parametrize(
    ("content_type", "boundary"),
    [("multipart/form-data; boundary=abc", b"abc"), ('multipart/form-data; charset=x; boundary="a b"', b"a b")],
)
def test_the_boundary_comes_from_the_content_type(content_type: str, boundary: bytes) -> None:
    assert boundary_of(content_type) == boundary


@pytest.mark.parametrize("content_type", ["application/json", "", "multipart/form-data"])
def test_anything_but_a_multipart_form_with_a_boundary_is_a_400(content_type: str) -> None:
    with pytest.raises(BadRequest):
        boundary_of(content_type)
