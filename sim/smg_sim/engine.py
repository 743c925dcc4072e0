"""The simulated inference engine: continuous-batching scheduler over a prefix KV cache.

Sits under the HTTP layer (`generation`, `openai_api`, `sglang_api`) and knows nothing of HTTP: it takes
token lists and yields per-step outputs. One scheduler task per engine mimics SGLang's event loop:

* arriving requests wait in a FIFO queue and are admitted while fewer than `max_running` run and their
  KV memory fits: a request's cached prefix is pinned in the prefix cache while it runs and shared with every
  other request of that prefix (counted once, as SGLang's radix cache does), its uncached prompt and its
  output are its own; the cache keeps, least recently used first, whatever the running requests leave;
* admitted requests are prefilled together in one step that takes `uncached_tokens / prefill_tps`
  (the cached prefix comes free) and yields each its first token; prefill has priority over decode;
* otherwise one decode step gives every running request one more token and takes
  `decode_step_ms + decode_step_ms_per_req * batch_size`.

All durations are simulated seconds multiplied by `time_scale`. A request whose consumer goes away
(client disconnect) is aborted and frees its slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from .config import SimConfig
from .kv_blocks import BlockTracker
from .kvcache import Pin, PrefixCache
from .tokens import StopMatcher, encode, prompt_seed, pseudo_text

if TYPE_CHECKING:
    from .kv_events import KvEventPublisher

log = logging.getLogger(__name__)

#: Token budget of one prefill batch (SGLang's default `max_prefill_tokens` is in this range).
MAX_PREFILL_TOKENS = 16384
#: Window of the generation-throughput estimate, in wall-clock seconds.
THROUGHPUT_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a request ended: `length` (max tokens), `stop` (stop string `matched`) or `abort`."""

    type: Literal["length", "stop", "abort"]
    matched: str | None = None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the engine needs to serve one sequence."""

    tokens: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    transferred_cached: int | None = None
    """Set on a PD decode worker: the KV arrived from a prefill worker (which had this many tokens
    cached), so prefill is skipped."""
    rid: str = ""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one request got from one engine step: new text (possibly empty) and its counters."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load and totals, for /v1/loads and /metrics."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    cached_tokens_in_tree: int
    gen_throughput: float
    requests_total: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    max_running: int

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Cumulative fraction of prompt tokens that were served from the prefix cache."""
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    @property
    def utilization(self) -> float:
        """The tighter of the two limits: batch slots or KV memory."""
        return max(self.num_running_reqs / self.max_running, self.token_usage)


def _log_crash(task: asyncio.Task[None]) -> None:
    """A dead scheduler would silently hang every request: make it loud."""
    if not task.cancelled() and task.exception() is not None:
        log.error("smg-sim scheduler crashed", exc_info=task.exception())


class _Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(eq=False, slots=True)
class _Seq:
    req: EngineRequest
    queue: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    phase: _Phase = _Phase.WAITING
    cached: int = 0
    generated: int = 0
    output: list[str] = field(default_factory=list)
    text_source: Iterator[str] = field(default_factory=lambda: iter(()))
    stops: StopMatcher = field(default_factory=lambda: StopMatcher(()))

    @property
    def prompt_len(self) -> int:
        return len(self.req.tokens)

    in_cache: bool = False
    """The prompt was inserted into the prefix cache (after its prefill, or when scheduled: ``cache_on``): from
    then on its KV is the cache's, shared with every request of the same prefix."""
    pin: Pin | None = None
    """Its cached prefix (then its whole prompt), pinned in the cache while it runs."""

    @property
    def _private_prompt(self) -> int:
        if self.req.transferred_cached is not None:
            return self.prompt_len  # KV sent by a prefill worker: this engine's cache has none of it
        return 0 if self.in_cache else self.prompt_len - self.cached

    @property
    def private_tokens(self) -> int:
        """KV this request holds outside the shared prefix cache: its uncached prompt until prefilled, then
        only its output."""
        return self.generated + self._private_prompt

    @property
    def reserve(self) -> int:
        """Private KV at its longest: what admission must not overcommit (the cached prefix is shared)."""
        return self._private_prompt + self.req.max_new_tokens


class RequestHandle:
    """One request inside the engine: `async with` submits it and aborts it on early exit."""

    def __init__(self, engine: Engine, req: EngineRequest) -> None:
        self._engine = engine
        self._seq = _Seq(req=req)

    async def __aenter__(self) -> RequestHandle:
        self._engine._submit(self._seq)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> StepOutput:
        if self._seq.phase is _Phase.DONE and self._seq.queue.empty():
            raise StopAsyncIteration
        return await self._seq.queue.get()

    def abort(self) -> None:
        """Leave the engine now (no-op once finished)."""
        self._engine._abort(self._seq)


class Engine:
    """Scheduler + KV cache of one simulated worker; start() it inside a running event loop."""

    def __init__(self, config: SimConfig) -> None:
        self._config = config
        self._kv_events: KvEventPublisher | None = None
        tracker = None
        if config.kv_events_endpoint is not None:
            from .kv_events import KvEventPublisher  # zmq is loaded only by a sim that publishes

            self._kv_events = KvEventPublisher(
                endpoint=config.kv_events_endpoint,
                replay_endpoint=config.kv_events_replay_endpoint,
                topic=config.kv_events_topic,
                fmt=config.kv_events_format,
                buffer_steps=config.kv_events_buffer_steps,
            )
            tracker = BlockTracker(block_size=config.block_size, sink=self._kv_events.add)
        self._cache = PrefixCache(config.kv_capacity, observer=tracker)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._throughput: deque[tuple[float, int]] = deque()
        self._requests_total = 0
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0
        self._generation_tokens_total = 0

    @property
    def cache(self) -> PrefixCache:
        return self._cache

    @property
    def kv_events(self) -> KvEventPublisher | None:
        """The KV-event publisher (``--kv-events-endpoint``), None when events are off."""
        return self._kv_events

    def start(self) -> None:
        """Start the scheduler task (and bind the KV-event sockets)."""
        if self._kv_events is not None and self._task is None:
            self._kv_events.start()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="smg-sim-scheduler")
            self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        """Stop the scheduler and end every pending request with an `abort` finish."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in [*self._waiting, *self._running]:
            self._finish(seq, FinishReason("abort"), "", cache_output=False)
        self._waiting.clear()
        if self._kv_events is not None:
            await self._kv_events.stop()

    def request(self, req: EngineRequest) -> RequestHandle:
        """A handle to use as `async with engine.request(req) as h: async for out in h: ...`."""
        return RequestHandle(self, req)

    def stats(self) -> EngineStats:
        now = time.monotonic()
        self._trim_throughput(now)
        generated = sum(n for _, n in self._throughput)
        return EngineStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            num_used_tokens=self._used_tokens(),
            max_total_num_tokens=self._config.kv_capacity,
            cached_tokens_in_tree=self._cache.size,
            gen_throughput=generated / THROUGHPUT_WINDOW_S,
            requests_total=self._requests_total,
            prompt_tokens_total=self._prompt_tokens_total,
            cached_tokens_total=self._cached_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            max_running=self._config.max_running,
        )

    # -- request bookkeeping -------------------------------------------------------------------

    def _submit(self, seq: _Seq) -> None:
        seq.text_source = pseudo_text(prompt_seed(seq.req.tokens))
        seq.stops = StopMatcher(seq.req.stop)
        self._requests_total += 1
        self._waiting.append(seq)
        self._wake.set()

    def _abort(self, seq: _Seq) -> None:
        if seq.phase is _Phase.DONE:
            return
        if seq.phase is _Phase.WAITING:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
        self._repin(seq, None)
        seq.phase = _Phase.DONE
        log.debug("request %s aborted after %d tokens", seq.req.rid, seq.generated)
        self._wake.set()

    def _used_tokens(self) -> int:
        """KV the running requests hold: their pinned prefixes (shared, counted once) and their own tokens."""
        return self._cache.locked + self._private_tokens()

    def _repin(self, seq: _Seq, length: int | None) -> None:
        """Move ``seq``'s pin to its first ``length`` tokens (None: release it)."""
        if seq.pin is not None:
            self._cache.unpin(seq.pin)
            seq.pin = None
        if length is not None:
            seq.pin = self._cache.pin(seq.req.tokens, length)

    def _cache_prompt(self, seq: _Seq) -> None:
        """Put ``seq``'s prompt in the prefix cache, pinned while it runs: its KV is the cache's from now on."""
        self._cache.insert(seq.req.tokens)
        self._repin(seq, seq.prompt_len)
        seq.in_cache = True

    def _private_tokens(self) -> int:
        """KV the running requests hold outside the prefix cache: the cache may keep the rest."""
        return sum(s.private_tokens for s in self._running)

    def _reserved_tokens(self) -> int:
        """Private KV the running requests will hold at their longest: admission must not overcommit it."""
        return sum(s.reserve for s in self._running)

    # -- scheduler -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = [s for s in self._running if s.phase is _Phase.PREFILL]
            if prefill:
                await self._prefill_step(prefill)
            else:
                await self._decode_step(list(self._running))

    def _admit(self) -> None:
        capacity = self._config.kv_capacity
        while self._waiting and len(self._running) < self._config.max_running:
            seq = self._waiting[0]
            pins = 0
            if seq.req.transferred_cached is not None:
                seq.cached = seq.req.transferred_cached
            else:
                # Like SGLang, at least the last prompt token is computed to get the first logits.
                seq.cached = max(0, min(self._cache.match(seq.req.tokens), seq.prompt_len - 1))
                pins = self._cache.unpinned(seq.req.tokens, seq.cached)
            if self._running and self._cache.locked + pins + self._reserved_tokens() + seq.reserve > capacity:
                break  # memory-bound: wait until running requests finish and free their KV
            self._waiting.popleft()
            if seq.req.transferred_cached is None:
                if self._config.cache_on == "schedule":
                    self._cache_prompt(seq)  # the requests admitted after it, in this step too, share it
                else:
                    seq.pin = self._cache.pin(seq.req.tokens, seq.cached)
            seq.phase = _Phase.DECODE if seq.req.transferred_cached is not None else _Phase.PREFILL
            self._prompt_tokens_total += seq.prompt_len
            self._cached_tokens_total += seq.cached
            self._running.append(seq)
            if seq.phase is _Phase.DECODE and seq.req.max_new_tokens == 0:
                self._finish(seq, FinishReason("length"), "")

    async def _prefill_step(self, candidates: list[_Seq]) -> None:
        batch: list[_Seq] = []
        budget = 0
        for seq in candidates:
            uncached = seq.prompt_len - seq.cached
            if batch and budget + uncached > MAX_PREFILL_TOKENS:
                break
            batch.append(seq)
            budget += uncached
        await self._sleep(budget / self._config.prefill_tps)
        produced = 0
        for seq in batch:
            if seq.phase is not _Phase.PREFILL:
                continue  # aborted meanwhile
            if not seq.in_cache:
                self._cache_prompt(seq)
            seq.phase = _Phase.DECODE
            if seq.req.max_new_tokens == 0:
                self._finish(seq, FinishReason("length"), "")
            else:
                self._emit_token(seq)
                produced += 1
        self._cache.evict(max(0, self._config.kv_capacity - self._private_tokens()))
        self._record_throughput(produced)

    async def _decode_step(self, batch: list[_Seq]) -> None:
        cfg = self._config
        await self._sleep((cfg.decode_step_ms + cfg.decode_step_ms_per_req * len(batch)) / 1000.0)
        produced = 0
        for seq in batch:
            if seq.phase is _Phase.DECODE:
                self._emit_token(seq)
                produced += 1
        self._record_throughput(produced)

    def _emit_token(self, seq: _Seq) -> None:
        ch = next(seq.text_source)
        seq.output.append(ch)
        seq.generated += 1
        self._generation_tokens_total += 1
        released, matched = seq.stops.feed(ch)
        if matched is not None:
            self._finish(seq, FinishReason("stop", matched), released)
        elif seq.generated >= seq.req.max_new_tokens:
            self._finish(seq, FinishReason("length"), released + seq.stops.flush())
        else:
            seq.queue.put_nowait(self._output(seq, released))

    def _finish(self, seq: _Seq, reason: FinishReason, text: str, *, cache_output: bool = True) -> None:
        if seq in self._running:
            self._running.remove(seq)
        self._repin(seq, None)
        seq.phase = _Phase.DONE
        seq.queue.put_nowait(self._output(seq, text, reason))
        if cache_output and seq.req.transferred_cached is None and seq.output:
            # Multi-turn chats resend the answer as part of the next prompt: keep it warm.
            self._cache.insert(seq.req.tokens + encode("".join(seq.output)))
            self._cache.evict(max(0, self._config.kv_capacity - self._private_tokens()))

    def _output(self, seq: _Seq, text: str, finish: FinishReason | None = None) -> StepOutput:
        return StepOutput(
            text=text,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.cached,
            completion_tokens=seq.generated,
            finish=finish,
        )

    async def _sleep(self, simulated_seconds: float) -> None:
        await asyncio.sleep(simulated_seconds * self._config.time_scale)

    def _record_throughput(self, produced: int) -> None:
        if produced:
            now = time.monotonic()
            self._throughput.append((now, produced))
            self._trim_throughput(now)

    def _trim_throughput(self, now: float) -> None:
        while self._throughput and self._throughput[0][0] < now - THROUGHPUT_WINDOW_S:
            self._throughput.popleft()
