"""The two legs' bodies of the vLLM PD mode and the requests it refuses (``smg_router.pd.vllm``)."""

from __future__ import annotations

import orjson
import pytest
from smg_router.errors import BadRequest, NotSupported, UpstreamError
from smg_router.pd.vllm import REMOTE_DECODE, check_request, decode_body, prefill_body, transfer_params

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 50,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 3,
    "temperature": 0.2,
}


def test_the_prefill_leg_asks_one_json_token_and_a_remote_decode() -> None:
    body = orjson.loads(prefill_body(CHAT))
    assert body == {
        "model": "m",
        "messages": CHAT["messages"],
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.2,
        "kv_transfer_params": dict(REMOTE_DECODE),
    }
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    # max_completion_tokens is capped too, when (and only when) the client set it
    capped = orjson.loads(prefill_body({**CHAT, "max_completion_tokens": 9}))
    assert capped["max_completion_tokens"] == 1 and capped["max_tokens"] == 1


def test_the_decode_leg_is_the_clients_body_plus_the_prefills_parameters_verbatim() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2], "tp_size": 1}
    body = orjson.loads(decode_body(CHAT, params))
    assert body == {**CHAT, "kv_transfer_params": params}


def test_what_cannot_be_split_is_refused() -> None:
    check_request("/v1/completions", {"prompt": [1, 2, 3]})  # one prompt of token ids
    check_request("/v1/completions", {"prompt": ["one"]})
    with pytest.raises(BadRequest, match="batch of 2"):
        check_request("/v1/completions", {"prompt": ["one", "two"]})
    with pytest.raises(BadRequest, match="batch of 2"):
        check_request("/v1/completions", {"prompt": [[1], [2]]})
    with pytest.raises(BadRequest, match="kv_transfer_params"):
        check_request("/v1/chat/completions", {"kv_transfer_params": {}})
    with pytest.raises(NotSupported, match="/generate"):
        check_request("/generate", {"text": "x"})


def test_a_prefill_answer_without_transfer_parameters_is_a_502_that_says_so() -> None:
    assert transfer_params(b'{"kv_transfer_params": {"remote_engine_id": "e"}}', "w-0123456789ab") == {
        "remote_engine_id": "e"
    }
    for answer in (b'{"choices": []}', b'{"kv_transfer_params": null}', b'{"kv_transfer_params": {}}'):
        with pytest.raises(UpstreamError) as err:
            transfer_params(answer, "w-0123456789ab")
        assert err.value.code == "missing_kv_transfer_params" and "w-0123456789ab" in err.value.message
    with pytest.raises(UpstreamError, match="no JSON object"):
        transfer_params(b"<html>", "w-0123456789ab")
