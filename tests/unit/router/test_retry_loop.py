"""The one retry loop (``smg_router.retry``), driven with scripted workers: no sockets, no real sleeps."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from smg_router.attempt import AttemptGuard, Attempts
from smg_router.errors import NoWorkerAvailable, UpstreamError, UpstreamTimeout
from smg_router.policies.registry import PolicyRegistry
from smg_router.request import ProxyRequest
from smg_router.retry import RetryBudget, RetryLoop, TryElsewhere
from smg_router.settings import RetrySettings
from smg_router.upstream import UpstreamConnectError, UpstreamResponse
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerStatus
from support.policy_env import Env, make_worker

ENDPOINT = "/v1/chat/completions"


class FakeAnswer:
    """A worker's answer head; records whether the loop freed it."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.headers: dict[str, str] = {}
        self.released = False

    def release(self) -> None:
        self.released = True

    def abort(self) -> None:
        self.released = True

    async def read(self) -> bytes:
        return b"{}"


Outcome = int | BaseException
"""A scripted attempt: the status the worker answers, or what sending to it raises."""
Use = Callable[[AttemptGuard, UpstreamResponse], Awaitable[tuple[str, int]]]


class Fleet:
    """Workers, the loop over them, and a script of what each attempt meets, in order (whichever worker it is)."""

    def __init__(
        self,
        env: Env,
        workers: int,
        *,
        max_retries: int = 2,
        backoff: float = 0.01,
        budget_ratio: float = 0.2,
        budget_min: int = 10,
    ) -> None:
        self.env = env
        self.registry = WorkerRegistry()
        self.workers: list[Worker] = [make_worker(n + 2) for n in range(workers)]
        for w in self.workers:
            self.registry.add(w)
        policies = PolicyRegistry(env.factory, env.settings)
        policies.sync(self.registry)
        self.attempts = Attempts(registry=self.registry, policies=policies, metrics=env.metrics)
        self.events: list[str] = []
        """What happened in order: ``send <url>`` and ``sleep <seconds>``."""
        self.sleeps: list[float] = []
        self.answers: list[FakeAnswer] = []
        settings = RetrySettings(
            max_retries=max_retries,
            backoff_initial=backoff,
            backoff_max=1.0,
            budget_ratio=budget_ratio,
            budget_min=budget_min,
        )
        self.loop = RetryLoop(attempts=self.attempts, settings=settings, metrics=env.metrics, sleep=self._sleep)
        self.script: list[Outcome] = []

    async def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.events.append(f"sleep {seconds}")

    async def send(self, guard: AttemptGuard) -> UpstreamResponse:
        self.events.append(f"send {guard.worker.url}")
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        answer = FakeAnswer(outcome)
        self.answers.append(answer)
        return answer  # type: ignore[return-value]

    async def use(self, guard: AttemptGuard, resp: UpstreamResponse) -> tuple[str, int]:
        return guard.worker.url, resp.status

    def sent_to(self) -> list[str]:
        return [e.removeprefix("send ") for e in self.events if e.startswith("send ")]

    def retries(self) -> float:
        return self.env.sample("smg_retries_total", endpoint=ENDPOINT, outcome="retried")

    def refused_by_budget(self) -> float:
        return self.env.sample("smg_retries_total", endpoint=ENDPOINT, outcome="budget_exhausted")

    async def run(
        self, *script: Outcome, use: Use | None = None, headers: dict[str, str] | None = None, **options: Any
    ) -> tuple[str, int]:
        """The loop over one request, its attempts meeting ``script``; ``options`` go to ``RetryLoop.run``."""
        self.script = list(script)
        req = request(headers)
        return await self.loop.run("regular", req, send=self.send, use=use or self.use, **options)


def request(headers: dict[str, str] | None = None) -> ProxyRequest:
    return ProxyRequest(
        headers=headers or {},
        endpoint=ENDPOINT,
        requested_model="m",
        stream=False,
        text="hello",
        head=0,
        body={"model": "m"},
        raw=b'{"model": "m"}',
        model="m",
    )


def refused() -> UpstreamConnectError:
    return UpstreamConnectError("connection refused")


async def test_a_connect_error_is_retried_and_the_next_worker_answers(env: Env) -> None:
    fleet = Fleet(env, 2)
    for w in fleet.workers:
        w.breaker.failure_threshold = 1  # one failure shows in ``breaker.allows()``
    url, status = await fleet.run(refused(), 200)
    first, second = fleet.sent_to()
    assert status == 200 and url == second and first != second
    failed = next(w for w in fleet.workers if w.url == first)
    assert not failed.breaker.allows()  # the failure reached the breaker (its threshold here is one)
    assert fleet.retries() == 1


async def test_a_5xx_is_set_aside_and_retried_on_another_worker(env: Env) -> None:
    fleet = Fleet(env, 2)
    url, status = await fleet.run(503, 200)
    first, second = fleet.sent_to()
    assert (url, status) == (second, 200) and first != second
    assert fleet.answers[0].released  # the 503 was freed, not passed on
    assert fleet.retries() == 1


async def test_a_429_is_retried_while_another_worker_is_left(env: Env) -> None:
    fleet = Fleet(env, 2)
    assert (await fleet.run(429, 200))[1] == 200
    assert len(set(fleet.sent_to())) == 2 and fleet.retries() == 1


async def test_a_429_is_passed_on_when_no_other_worker_is_left(env: Env) -> None:
    fleet = Fleet(env, 1, max_retries=2)
    url, status = await fleet.run(429)
    assert (url, status) == (fleet.workers[0].url, 429)
    assert fleet.workers[0].breaker.allows()  # back-pressure, not a fault
    assert fleet.sleeps == [] and fleet.retries() == 0  # the client's own back-off is the remedy


async def test_the_last_attempts_5xx_is_passed_on(env: Env) -> None:
    fleet = Fleet(env, 3, max_retries=1)
    assert (await fleet.run(500, 502))[1] == 502
    assert len(fleet.sent_to()) == 2 and fleet.retries() == 1


async def test_attempts_that_all_fail_to_connect_end_in_upstream_unavailable(env: Env) -> None:
    fleet = Fleet(env, 3, max_retries=2)
    with pytest.raises(UpstreamError, match=r"after 3 attempt\(s\): connection refused") as e:
        await fleet.run(refused(), refused(), refused())
    assert e.value.code == "upstream_unavailable" and e.value.status == 502
    assert len(set(fleet.sent_to())) == 3 and fleet.retries() == 2


async def test_a_last_attempt_that_timed_out_is_a_504(env: Env) -> None:
    fleet = Fleet(env, 2, max_retries=1)
    with pytest.raises(UpstreamTimeout, match=r"in time after 2 attempt\(s\)"):
        await fleet.run(refused(), TimeoutError())


async def test_running_out_of_workers_ends_the_loop_with_the_paths_own_error(env: Env) -> None:
    fleet = Fleet(env, 1, max_retries=3)

    def gave_up(last: Exception, tried: int) -> Exception:
        return UpstreamError(f"{last} (after {tried} prefill attempt(s))", code="prefill_failed")

    with pytest.raises(UpstreamError, match=r"^connection refused \(after 1 prefill attempt\(s\)\)$") as e:
        await fleet.run(refused(), gave_up=gave_up)
    assert e.value.code == "prefill_failed"
    assert fleet.retries() == 1  # the retry was counted before it found no other worker


async def test_no_worker_at_all_is_the_503_of_the_first_attempt(env: Env) -> None:
    fleet = Fleet(env, 1)
    fleet.workers[0].status = WorkerStatus.NOT_READY
    with pytest.raises(NoWorkerAvailable):
        await fleet.run()
    assert fleet.events == []


async def test_the_backoff_comes_between_attempts_and_doubles(env: Env) -> None:
    fleet = Fleet(env, 3, max_retries=2, backoff=0.2)
    await fleet.run(refused(), 503, 200)
    kinds = [e.split()[0] for e in fleet.events]
    assert kinds == ["send", "sleep", "send", "sleep", "send"]
    first, second = fleet.sleeps
    assert 0.1 <= first <= 0.2 and 0.2 <= second <= 0.4  # jittered down to half at most


async def test_the_retries_metric_counts_each_retry_and_nothing_for_a_first_answer(env: Env) -> None:
    fleet = Fleet(env, 3, max_retries=2)
    await fleet.run(200)
    assert fleet.retries() == 0
    await fleet.run(500, 500, 200)
    assert fleet.retries() == 2


async def test_an_answer_broken_off_in_use_is_retried_elsewhere(env: Env) -> None:
    fleet = Fleet(env, 2)
    broken: list[str] = []

    async def use(guard: AttemptGuard, resp: UpstreamResponse) -> tuple[str, int]:
        if not broken:
            broken.append(guard.worker.url)
            raise TryElsewhere(UpstreamError("broke off"))
        return guard.worker.url, resp.status

    url, _ = await fleet.run(200, 200, use=use)
    assert url != broken[0] and fleet.retries() == 1


async def test_an_upload_partly_sent_is_not_sent_again(env: Env) -> None:
    fleet = Fleet(env, 3)

    class PartlySent:
        replayable = False

    req = request()
    req.upload = PartlySent()  # type: ignore[assignment]
    fleet.script = [refused(), 200]
    with pytest.raises(UpstreamError, match=r"after 1 attempt\(s\)"):
        await fleet.loop.run("regular", req, send=fleet.send, use=fleet.use)
    assert len(fleet.sent_to()) == 1 and fleet.retries() == 0


async def test_a_first_attempt_opened_by_the_caller_is_used_then_excluded(env: Env) -> None:
    fleet = Fleet(env, 2)
    first = fleet.attempts.open("regular", request())
    await fleet.run(503, 200, first=first)
    assert fleet.sent_to()[0] == first.worker.url and fleet.sent_to()[1] != first.worker.url
    assert all(w.inflight == 0 for w in fleet.workers)  # every attempt's guard closed


async def test_a_timeout_once_the_request_was_written_is_a_504_not_a_second_run(env: Env) -> None:
    fleet = Fleet(env, 3, max_retries=2)
    with pytest.raises(UpstreamTimeout, match=r"in time after 1 attempt\(s\)"):
        await fleet.run(TimeoutError(), 200)
    assert len(fleet.sent_to()) == 1 and fleet.retries() == 0  # the worker may still be running it
    assert fleet.script == [200]


async def test_a_timeout_is_retried_when_the_client_sends_an_idempotency_key(env: Env) -> None:
    fleet = Fleet(env, 3, max_retries=2)
    url, status = await fleet.run(TimeoutError(), 200, headers={"idempotency-key": "k-1"})
    first, second = fleet.sent_to()
    assert (url, status) == (second, 200) and first != second and fleet.retries() == 1


async def test_the_retry_budget_bounds_the_attempts_of_a_fleet_answering_429(env: Env) -> None:
    fleet = Fleet(env, 2, max_retries=2, budget_min=3)
    statuses = [(await fleet.run(429, 429))[1] for _ in range(100)]  # a retry's 429 is passed on: no worker left
    assert statuses == [429] * 100
    sends = len(fleet.sent_to())
    assert sends <= 120, sends  # 20% of 100 requests
    assert sends >= 115, sends  # the budget is used, not merely refused
    assert fleet.retries() == sends - 100
    assert fleet.refused_by_budget() == 100 - fleet.retries()


async def test_the_retry_budget_refuses_a_connect_errors_retry_with_the_error_so_far(env: Env) -> None:
    fleet = Fleet(env, 3, max_retries=2, budget_ratio=0.0, budget_min=1)
    await fleet.run(refused(), 200)  # the minimum's one retry
    with pytest.raises(UpstreamError, match=r"after 1 attempt\(s\): connection refused"):
        await fleet.run(refused(), 200)
    assert fleet.retries() == 1 and fleet.refused_by_budget() == 1


def test_the_retry_budget_forgets_the_requests_and_retries_of_more_than_ten_seconds_ago() -> None:
    now = [1000.0]
    budget = RetryBudget(ratio=0.5, minimum=1, clock=lambda: now[0])
    for _ in range(4):
        budget.request()
    assert [budget.take() for _ in range(3)] == [True, True, False]  # half of four
    now[0] += 5
    budget.request()
    budget.request()
    assert budget.take() and not budget.take()  # half of six: one more
    now[0] += 6  # the first four requests and their two retries aged out; two requests and one retry are left
    assert not budget.take()  # the minimum (one) and half of two are used
    budget.request()
    budget.request()
    assert budget.take() and not budget.take()
    now[0] += 60  # everything aged out: the minimum again
    assert budget.take() and not budget.take()
