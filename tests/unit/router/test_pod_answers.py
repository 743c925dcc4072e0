"""``--processes``: how the parent answers a lifecycle change from its processes' answers (``pod.Pod``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import pytest
from smg_router.errors import RouterError
from smg_router.pod import Children, Pod
from smg_router.settings import Settings

Answer = tuple[int, bytes, dict[str, str]] | Exception
JSON = {"Content-Type": "application/json"}


class _Children(Children):
    def __init__(self, answers: list[Answer]) -> None:
        super().__init__("/nowhere", len(answers))
        self.answers = answers
        self.calls: list[tuple[int, str, str]] = []

    async def call(
        self, index: int, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        self.calls.append((index, method, target))
        answer = self.answers[index]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _error(status: int, message: str) -> tuple[int, bytes, dict[str, str]]:
    return status, orjson.dumps({"error": {"message": message, "type": "x", "code": "y"}}), JSON


async def _change(answers: list[Answer], path: str = "/workers") -> Any:
    children = _Children(answers)
    pod = Pod(Settings(), children)
    request = SimpleNamespace(method="POST", path=path, query_string="")
    response = await pod._everywhere(request, b"{}", {})  # type: ignore[arg-type]
    assert sorted(i for i, _, _ in children.calls) == list(range(len(answers)))  # every process was asked
    return response


async def test_every_process_applying_it_gives_their_answer_created_when_one_created_it() -> None:
    response = await _change([(200, b'{"id": "w"}', JSON), (201, b'{"id": "w"}', JSON)])
    assert response.status == 201 and response.body == b'{"id": "w"}'


async def test_every_process_refusing_it_alike_passes_the_refusal_on() -> None:
    response = await _change([_error(400, "priority: must be an integer")] * 2)
    assert response.status == 400 and b"priority" in response.body


async def test_processes_that_disagree_or_fail_give_a_502_naming_each_answer() -> None:
    with pytest.raises(RouterError) as raised:
        await _change([(201, b"{}", JSON), aiohttp.ClientConnectionError("refused")])
    assert raised.value.status == 502 and raised.value.code == "processes_disagree"
    assert "process 0: 201" in raised.value.message
    assert "process 1: no answer (ClientConnectionError: refused)" in raised.value.message
    with pytest.raises(RouterError) as raised:
        await _change([(200, b"{}", JSON), _error(404, "no worker with id 'w'")])
    assert "process 1: 404 no worker with id 'w'" in raised.value.message


async def test_a_peer_batch_answer_adds_the_counts_and_lists_every_process_s_leads() -> None:
    a = {"applied": 2, "ignored": 0, "id": "a", "leads": []}
    b = {"applied": 1, "ignored": 1, "id": "b", "leads": [["http://w", "pre"]]}
    response = await _change([(200, orjson.dumps(a), JSON), (200, orjson.dumps(b), JSON)], "/peers/routes")
    assert orjson.loads(response.body) == {"applied": 3, "ignored": 1, "id": "b", "leads": [["http://w", "pre"]]}
