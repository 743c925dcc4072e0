"""The request plans of the routing benchmark: what is sent, in which order, and which requests arrive together.

Pure and seeded: the same ``--seed`` gives the same prompts and order for every target, replica count and load,
so the cells of one run differ only in the router.  Each request carries the engine prompt exactly as the
simulated worker will see it (chat messages go through the sim's own template) and the answer the sim will
give (its output is a deterministic function of the prompt), so the oracle and the capacity can be computed
before anything runs and a multi-turn session can resend its history word for word.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from smg_sim.openai_api import chat_prompt
from smg_sim.tokens import encode, prompt_seed, pseudo_text

MODEL = "sim-model"
Endpoint = Literal["completions", "chat"]
WORKLOADS = ("shared_prefix", "multi_turn", "unique", "bursty", "long", "zipf", "wide")

_VOCABULARY = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu amber basalt cobalt dune ember fjord granite "
    "harbor iris jasper kelp lagoon marble nectar opal prairie quartz reef saffron tundra umber velvet willow"
)
_WORDS = tuple(_VOCABULARY.split())


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a plan."""

    index: int
    endpoint: Endpoint
    prompt: str
    """The engine prompt (for chat: the sim's template applied to ``messages``); 1 character = 1 token."""
    max_tokens: int
    event: int
    """Arrival event: requests with the same event arrive together (a burst); otherwise one event each."""
    messages: tuple[tuple[str, str], ...] = ()
    """Chat only: (role, content) of every message, the history first."""
    after: int | None = None
    """Chat only: the previous turn of the same session, which must have been answered before this is sent."""
    answer: str = field(default="", compare=False)
    """What the simulated worker answers (its pseudo-text is seeded by the prompt)."""

    def body(self, *, model: str = MODEL) -> dict[str, Any]:
        """The streaming OpenAI request body (usage in the last chunk, for the cached-token count)."""
        common: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            return {**common, "messages": [{"role": r, "content": c} for r, c in self.messages]}
        return {**common, "prompt": self.prompt}


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    requests: tuple[PlannedRequest, ...]
    kv_capacity: int
    """Default KV capacity per worker (tokens) for this workload, when ``--kv-capacity`` is not given."""
    max_running: int = 16
    """Default running slots per worker for this workload, when ``--max-running`` is not given."""

    @property
    def events(self) -> int:
        return len({r.event for r in self.requests})


def sim_answer(prompt: str, max_tokens: int) -> str:
    """The sim's completion of ``prompt`` (no stop strings): ``max_tokens`` characters of its pseudo-text."""
    source = pseudo_text(prompt_seed(encode(prompt)))
    return "".join(next(source) for _ in range(max_tokens))


def _text(rng: random.Random, chars: int) -> str:
    """Random words, exactly ``chars`` characters long."""
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def _completion(index: int, prompt: str, max_tokens: int, event: int) -> PlannedRequest:
    return PlannedRequest(
        index=index,
        endpoint="completions",
        prompt=prompt,
        max_tokens=max_tokens,
        event=event,
        answer=sim_answer(prompt, max_tokens),
    )


def shared_prefix(
    rng: random.Random, *, groups: int = 12, questions: int = 10, prefix_chars: int = 2000, question_chars: int = 48
) -> Workload:
    """G documents of ``prefix_chars`` each asked Q short questions, all shuffled together."""
    prefixes = [f"[document {g}] " + _text(rng, prefix_chars - len(f"[document {g}] ")) for g in range(groups)]
    prompts = [
        f"{prefixes[g]}\n\nQuestion {q}: {_text(rng, question_chars)}" for g in range(groups) for q in range(questions)
    ]
    rng.shuffle(prompts)
    reqs = tuple(_completion(i, p, 16, i) for i, p in enumerate(prompts))
    return Workload(
        "shared_prefix",
        f"{groups} groups x {questions} questions, shared prefix {prefix_chars} chars, shuffled",
        reqs,
        kv_capacity=7000,
    )


def unique(rng: random.Random, *, count: int = 120, chars: int = 1000) -> Workload:
    """Prompts that share nothing (each starts with its own number, then random words)."""
    reqs = tuple(_completion(i, f"{i:05d} " + _text(rng, chars - 6), 16, i) for i in range(count))
    return Workload("unique", f"{count} unique prompts of {chars} chars", reqs, kv_capacity=7000)


def long_prompts(
    rng: random.Random, *, groups: int = 6, questions: int = 6, prefix_chars: int = 16000, question_chars: int = 64
) -> Workload:
    """Long-document QA: G documents of 16k+ characters, Q questions each, shuffled."""
    docs = [f"[long document {g}] " + _text(rng, prefix_chars) for g in range(groups)]
    prompts = [
        f"{docs[g]}\n\nQuestion {q}: {_text(rng, question_chars)}" for g in range(groups) for q in range(questions)
    ]
    rng.shuffle(prompts)
    reqs = tuple(_completion(i, p, 16, i) for i, p in enumerate(prompts))
    return Workload(
        "long",
        f"{groups} documents of {prefix_chars}+ chars x {questions} questions, shuffled",
        reqs,
        kv_capacity=64000,
    )


def bursty(
    rng: random.Random,
    *,
    groups: int = 6,
    bursts_per_group: int = 2,
    burst_size: int = 8,
    singles: int = 32,
    prefix_chars: int = 1500,
) -> Workload:
    """Bursts of ``burst_size`` questions on one shared prefix arriving at once, between unique single prompts."""
    prefixes = [f"[manual {g}] " + _text(rng, prefix_chars) for g in range(groups)]
    events: list[list[str]] = []
    for g in range(groups):
        for b in range(bursts_per_group):
            events.append([f"{prefixes[g]}\n\nAsk {b}.{q}: {_text(rng, 40)}" for q in range(burst_size)])
    events += [[f"{s:05d} single " + _text(rng, 600)] for s in range(singles)]
    rng.shuffle(events)
    reqs: list[PlannedRequest] = []
    for e, prompts in enumerate(events):
        base = len(reqs)
        reqs += [_completion(base + k, p, 16, e) for k, p in enumerate(prompts)]
    return Workload(
        "bursty",
        f"{groups * bursts_per_group} bursts of {burst_size} on {groups} prefixes of {prefix_chars} chars"
        f" + {singles} unique prompts",
        tuple(reqs),
        kv_capacity=7000,
    )


def multi_turn(
    rng: random.Random,
    *,
    sessions: int = 24,
    turns: int = 6,
    system_chars: int = 400,
    first_chars: int = 300,
    user_chars: int = 150,
    answer_tokens: int = 48,
) -> Workload:
    """Chat sessions: every turn resends the whole history (shared system prompt, earlier turns and answers)."""
    system = "You are a helpful assistant. " + _text(rng, system_chars)
    order = [s for s in range(sessions) for _ in range(turns)]
    rng.shuffle(order)  # sessions interleave; each one's turns stay in order
    history: dict[int, list[tuple[str, str]]] = {s: [("system", system)] for s in range(sessions)}
    last: dict[int, int] = {}
    reqs: list[PlannedRequest] = []
    for s in order:
        turn = sum(1 for r, _ in history[s] if r == "user")
        size = first_chars if turn == 0 else user_chars
        msgs = (*history[s], ("user", f"(user {s}, turn {turn}) " + _text(rng, size)))
        prompt = chat_prompt([{"role": r, "content": c} for r, c in msgs])
        answer = sim_answer(prompt, answer_tokens)
        i = len(reqs)
        reqs.append(PlannedRequest(i, "chat", prompt, answer_tokens, i, msgs, last.get(s), answer))
        history[s] = [*msgs, ("assistant", answer)]
        last[s] = i
    return Workload(
        "multi_turn", f"{sessions} chat sessions x {turns} turns, shared system prompt", tuple(reqs), kv_capacity=24000
    )


def zipf(
    rng: random.Random,
    *,
    groups: int = 24,
    requests: int = 240,
    exponent: float = 1.1,
    prefix_chars: int = 2000,
    question_chars: int = 48,
) -> Workload:
    """Shared-prefix questions whose groups are not equally popular: group g is asked with weight 1/(g+1)^exponent
    (a few hot documents, a long tail asked once or twice), in random order."""
    prefixes = [f"[article {g}] " + _text(rng, prefix_chars - len(f"[article {g}] ")) for g in range(groups)]
    weights = [1.0 / (g + 1) ** exponent for g in range(groups)]
    picks = rng.choices(range(groups), weights=weights, k=requests)
    prompts = [f"{prefixes[g]}\n\nQuestion {i}: {_text(rng, question_chars)}" for i, g in enumerate(picks)]
    reqs = tuple(_completion(i, p, 16, i) for i, p in enumerate(prompts))
    return Workload(
        "zipf",
        f"{requests} questions on {groups} prefixes of {prefix_chars} chars, popularity Zipf({exponent})",
        reqs,
        kv_capacity=7000,
    )


def wide(
    rng: random.Random,
    *,
    groups: int = 16,
    questions: int = 20,
    prefix_chars: int = 1500,
    question_chars: int = 48,
    answer_tokens: int = 128,
) -> Workload:
    """Engines that run many requests at once (256 slots each, as a vLLM or SGLang engine on a GPU): shared-prefix
    questions with long answers, so that each worker decodes tens of requests together and its backlog counts
    run in the tens, not the few of a 16-slot engine."""
    prefixes = [f"[guide {g}] " + _text(rng, prefix_chars - len(f"[guide {g}] ")) for g in range(groups)]
    prompts = [
        f"{prefixes[g]}\n\nQuestion {q}: {_text(rng, question_chars)}" for g in range(groups) for q in range(questions)
    ]
    rng.shuffle(prompts)
    reqs = tuple(_completion(i, p, answer_tokens, i) for i, p in enumerate(prompts))
    return Workload(
        "wide",
        f"{groups} groups x {questions} questions, prefix {prefix_chars} chars, {answer_tokens}-token answers,"
        " 256 slots a worker",
        reqs,
        kv_capacity=60000,
        max_running=256,
    )


def build(name: str, seed: int, *, shared: dict[str, int] | None = None) -> Workload:
    """The plan of workload ``name`` for ``seed``; ``shared`` overrides the sizes of ``shared_prefix``."""
    rng = random.Random(f"{name}:{seed}")
    if name == "shared_prefix" and shared:
        return shared_prefix(rng, **shared)
    builders: dict[str, Callable[[random.Random], Workload]] = {
        "shared_prefix": shared_prefix,
        "multi_turn": multi_turn,
        "unique": unique,
        "bursty": bursty,
        "long": long_prompts,
        "zipf": zipf,
        "wide": wide,
    }
    if name not in builders:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return builders[name](rng)


def arrivals(workload: Workload, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets (simulated seconds) of every request: Poisson arrival events at ``rate`` requests/s.

    Events come at ``rate * events / requests`` per second, so the mean request rate is ``rate`` whether or
    not requests come in bursts; the requests of one event arrive together.
    """
    event_rate = rate * workload.events / len(workload.requests)
    offsets: list[float] = []
    t = 0.0
    current: int | None = None
    for r in workload.requests:
        if r.event != current:
            t += rng.expovariate(event_rate)
            current = r.event
        offsets.append(t)
    return offsets
