"""Routing text and load parsing: pure functions of the request path and the load monitor."""

from __future__ import annotations

import json

import pytest
from smg_router.errors import BadRequest
from smg_router.fleet.load_monitor import parse_loads, parse_metrics
from smg_router.request import parse_request
from smg_router.workers.worker import SpecError, normalize_url


def test_chat_routing_text_covers_every_message_in_order() -> None:
    raw = (
        b'{"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": '
        b'[{"type": "text", "text": "U1"}, {"type": "image_url", "image_url": {}}]}, '
        b'{"role": "assistant", "content": "A"}, {"role": "user", "content": "U2"}]}'
    )
    p = parse_request("chat", raw)
    assert p.text == "<|system|>S\n<|user|>U1\n<|assistant|>A\n<|user|>U2\n"
    # a conversation that grows keeps its earlier text as a prefix
    shorter = parse_request("chat", b'{"messages": [{"role": "system", "content": "S"}]}')
    assert p.text.startswith(shorter.text)


def test_generate_text_and_token_ids() -> None:
    assert parse_request("generate", b'{"text": "hello"}').text == "hello"
    ids = parse_request("generate", b'{"input_ids": [104, 105, 300000]}').text
    assert ids.startswith("hi") and len(ids) == 3
    assert parse_request("completions", b'{"prompt": ["a", "b"], "stream": true}').text == "a\nb"
    assert parse_request("completions", b'{"prompt": "x", "stream": true}').stream is True


@pytest.mark.parametrize(
    ("kind", "raw", "words"),
    [
        ("chat", b"", "empty"),
        ("chat", b"{", "not valid JSON"),
        ("chat", b'"s"', "JSON object"),
        ("chat", b'{"messages": []}', "messages"),
        ("chat", b'{"messages": [{"content": "x"}]}', "role"),
        ("completions", b'{"prompt": {"a": 1}}', "prompt"),
        ("generate", b"{}", "text or input_ids"),
        ("chat", b'{"model": 3, "messages": [{"role": "u", "content": "x"}]}', "model"),
    ],
)
def test_bad_bodies_name_the_problem(kind: str, raw: bytes, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        parse_request(kind, raw)


def test_parse_loads_sums_ranks_and_refuses_garbage() -> None:
    body = (
        b'{"timestamp": "2026-11-30T10:00:00Z", "dp_rank_count": 2, "loads": ['
        b'{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 4},'
        b'{"dp_rank": 1, "num_running_reqs": 499999996, "num_waiting_reqs": 499999997}]}'
    )
    assert parse_loads(body) == 10**9  # exact at the bound (MAX_BACKLOG)
    # negative, non-numeric and absurd counters are a bad report, not 0 or a huge load
    # (hostile numbers in full: test_load_parsing.py)
    for bad in (
        b'{"loads": [{"num_running_reqs": -5}]}',
        b'{"loads": [{"num_waiting_reqs": true}]}',
        b'{"loads": [{"num_running_reqs": 9223372036854775807}]}',
    ):
        with pytest.raises(ValueError):
            parse_loads(bad)
    with pytest.raises(ValueError):
        parse_loads(b'{"status": "ok"}')


def test_parse_metrics_reads_sglang_vllm_and_llamacpp() -> None:
    text = """# HELP sglang:num_running_reqs x
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",dp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="m",dp_rank="0"} 5.0
sglang:token_usage{model_name="m"} 0.5
"""
    assert parse_metrics(text) == 7
    assert parse_metrics('vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting{x="y"} 3\n') == 4
    assert parse_metrics("llamacpp:requests_processing 2\nllamacpp:requests_deferred 1 1700000000\n") == 3
    with pytest.raises(ValueError):
        parse_metrics("process_cpu_seconds_total 3\n")


@pytest.mark.parametrize("bad", ["", "localhost:8000", "http://", "http://h:0x1", "http://h:8000/path", 7])
def test_worker_urls_are_validated(bad: object) -> None:
    with pytest.raises(SpecError, match="url"):
        normalize_url(bad)


def test_worker_url_is_normalised() -> None:
    assert normalize_url("http://127.0.0.2:8000/") == "http://127.0.0.2:8000"


def test_the_head_of_a_chat_ends_with_its_first_user_message() -> None:
    from smg_router.request import parse_request

    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "second"},
    ]
    req = parse_request("chat", json.dumps({"messages": messages}).encode())
    assert req.text[: req.head] == "<|system|>sys\n<|user|>first\n"
    no_user = parse_request("chat", json.dumps({"messages": messages[:1]}).encode())
    assert no_user.head == len(no_user.text)
    salted = parse_request("chat", json.dumps({"messages": messages, "cache_salt": "s"}).encode())
    assert salted.text[: salted.head].endswith("<|user|>first\n") and salted.text.startswith("\x00cache_salt=")
    plain = parse_request("completions", b'{"prompt": "abc"}')
    assert plain.head == 0 and plain.text == "abc"
