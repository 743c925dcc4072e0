"""Stateful Responses through any replica: the id a router returns names its worker (``response_ids``), so a
follow-up reaches the worker that stored the response whichever replica it arrives at; and answers name the
worker by its opaque id only, unless ``--expose-worker-url``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support.procs import MODEL, Router, Sim, http_json_headers, start_router, start_sim


@pytest.fixture(scope="module")
def sims(logs: Path) -> Iterator[list[Sim]]:
    fleet = [start_sim(logs) for _ in range(4)]
    yield fleet
    for s in fleet:
        s.stop()


@pytest.fixture(scope="module")
def replicas(logs: Path, sims: list[Sim]) -> Iterator[tuple[Router, Router]]:
    urls = [s.url for s in sims]
    a, b = start_router(logs, workers=urls), start_router(logs, workers=list(reversed(urls)))
    for r in (a, b):
        r.wait_routable(len(sims))
    yield a, b
    a.stop()
    b.stop()


async def test_a_follow_up_through_the_other_replica_reaches_the_worker_that_stored_the_response(
    replicas: tuple[Router, Router],
) -> None:
    a, b = replicas
    answered = 0
    async with (
        openai.AsyncOpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0) as via_a,
        openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="none", max_retries=0) as via_b,
    ):
        for i in range(20):
            if i % 2:  # streamed: the id is tagged in every event that carries it
                stream = await via_a.responses.create(
                    model=MODEL, input=f"{uuid.uuid4()} tell me", stream=True, max_output_tokens=2
                )
                (first,) = [e.response.id async for e in stream if e.type == "response.created"]
            else:
                first = (await via_a.responses.create(model=MODEL, input=f"{uuid.uuid4()} hi", max_output_tokens=2)).id
            try:
                follow = await via_b.responses.create(
                    model=MODEL, input="and then?", previous_response_id=first, max_output_tokens=2
                )
            except openai.NotFoundError:
                continue
            assert follow.previous_response_id == first
            answered += 1
    assert answered == 20


def test_answers_name_the_worker_by_its_opaque_id_unless_told_to_expose_its_url(logs: Path, sims: list[Sim]) -> None:
    r = start_router(logs, workers=[sims[0].url], env={"SMG_EXPOSE_WORKER_URL": ""})  # the router's default
    try:
        r.wait_routable(1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        status, _, headers = http_json_headers("POST", r.url + "/v1/chat/completions", body)
        assert status == 200
        assert headers["x-smg-worker-id"] == r.workers()[0]["id"]
        assert headers.get("x-smg-routed-worker-id") is None
        assert not [k for k, v in headers.items() if sims[0].host in v and not k.lower().startswith("x-smg-sim")]
    finally:
        r.stop()
