"""Routing benchmark on real engines: the shared-prefix workload on 2-4 llama.cpp servers.

Usage (from the repository root, with the project's venv):
    .venv/bin/python bench/routing/llamacpp.py [--engines 2] [--slots 2] [--groups G] [--questions 10]
        [--replicas 1,2] [--targets smg:cache_aware,smg:round_robin,rust:cache_aware] [--concurrency C]
        [--router-arg=--flag=value ...] [--rust-arg=...] [--router-commit REV] [--out llamacpp-results.json]

The engines are llama.cpp's own server from the ``xllamacpp`` wheel serving the generated tiny model of the
engine test tier (``tests/support/llamacpp.py``: one ASCII character = one token, no host-RAM prompt cache),
each with ``--slots`` slots.  A slot keeps the KV of its last prompt and a new request takes the idle slot
whose cache shares most of its prompt, else the least recently used one, so an engine holds at most
``--slots`` prefixes: with more groups than ``engines x slots`` eviction is real.  For every cell
(replicas x target) the engines are restarted on the same addresses (cold caches, zeroed counters, the same
worker ids), ``--replicas`` fresh routers start in front of them, and the plan is sent closed-loop by
``--concurrency`` clients, request ``i`` to replica ``i mod replicas``.  Figures come from the engines' own
answers: ``usage.prompt_tokens_details.cached_tokens`` and ``timings.prompt_ms``.  Targets are written as in
``run.py``: ``smg:<policy>[+peers][~VARIANT][@REV]``, ``@REV`` running smg-router of git revision REV (else that of
``--router-commit``, else the working tree), so before and after run in one run.

The target ``pinned`` is no router: the best schedule this machine can run, as a reference for the routers'
figures.  The clients send group ``g`` straight to engine ``g mod engines`` (with ``--groups`` = engines x
slots, each engine's slots hold its groups for the whole run) and one request of a group at a time, as
smg-router's turns do (a second request on a busy slot's prompt would take, and evict, the engine's other
slot).  Its prefill p90/p50 is what the machine alone makes of the plan: on 2 cores, 4 single-thread engines
prefilling at once take up to twice as long as one alone, whatever sent them the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

import aiohttp  # noqa: E402
from fleet import (  # noqa: E402
    VLLM_BIN,
    Launch,
    Target,
    TargetCode,
    decision_counts,
    parse_variants,
    resolve_commit,
    start_replicas,
    stop_all,
    target_code,
)
from oracle import common_prefix_len, oracle_cached  # noqa: E402
from report import percentile  # noqa: E402
from support.llamacpp import MODEL_ID, LlamaServer, start_llama_server, tiny_model  # noqa: E402
from support.procs import http_json, metric_value, next_host  # noqa: E402
from workloads import shared_prefix  # noqa: E402

DEFAULT_TARGETS = "smg:cache_aware,smg:round_robin,rust:cache_aware"
PINNED = "pinned"
"""The reference target: no router, each group pinned to one engine, one request of a group at a time."""
RUST_BIN = "/tmp/smg-rust/bin/smg"
SLOT_PROMPT_SIMILARITY = 0.1
"""llama.cpp's default ``--slot-prompt-similarity``: a slot is reused for its cache above this share."""
_GROUP = re.compile(r"\[document (\d+)\] ")


def _csv(kind: type[Any]) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2, help="llama.cpp servers (2-4)")
    p.add_argument("--slots", type=int, default=2, help="slots per server: the prefixes a server can hold")
    p.add_argument("--ctx", type=int, default=0, help="KV tokens per server, split over its slots (0: 4096 a slot)")
    p.add_argument("--threads", type=int, default=1, help="threads per server")
    p.add_argument(
        "--engine-port",
        type=int,
        default=0,
        help="port of every server, each on its own 127.0.0.x (0: a free port). smg-router's worker ids, hence"
        " its rendezvous placement of the groups, are hashes of the URLs: a fixed port makes them repeat",
    )
    p.add_argument("--groups", type=int, default=0, help="shared-prefix groups (0: 2 x engines x slots)")
    p.add_argument("--questions", type=int, default=10, help="questions per group")
    p.add_argument("--prefix-chars", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=0, help="closed-loop clients (0: one per engine)")
    p.add_argument("--replicas", type=_csv(int), default=[1, 2])
    p.add_argument(
        "--targets",
        type=_csv(str),
        default=DEFAULT_TARGETS.split(","),
        help=f"smg:<policy>[+peers][~VARIANT][@REV] / rust:<policy>[~VARIANT] / vllm:<policy>[~VARIANT] / {PINNED}"
        " (no router: the reference"
        " schedule)",
    )
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for every smg-router (repeatable)")
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=0,
        help="set every worker's kv_capacity_tokens on every smg-router replica (PATCH /workers): llama.cpp reports"
        " none, so without it the tree's KV cap (and the room of placement) is off; a slot's tokens times the slots"
        " tells the router how many prefixes an engine holds (0: not set)",
    )
    p.add_argument("--rust-arg", action="append", default=[], help="extra flag for every Rust smg (repeatable)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help='NAME="FLAGS": the flags of a target written TARGET~NAME (repeatable), as in run.py',
    )
    p.add_argument("--rust-bin", default=RUST_BIN)
    p.add_argument("--vllm-bin", default=VLLM_BIN, help="vLLM's router, for the targets vllm:<policy>")
    p.add_argument(
        "--router-commit",
        default=None,
        help="run smg-router of this commit (git archive, first on PYTHONPATH) for every smg target without @REV",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts and their order")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "out" / "routing" / "llamacpp.json", help="(git ignores bench/out)"
    )
    p.add_argument("--keep-logs", type=Path, default=None, help="keep the processes' logs here")
    a = p.parse_args(argv)
    if not 1 <= a.engines <= 8 or a.slots < 1:
        p.error("--engines 1-8 and --slots >= 1")
    a.groups = a.groups or 2 * a.engines * a.slots
    a.ctx = a.ctx or 4096 * a.slots
    a.concurrency = a.concurrency or a.engines
    try:
        a.targets = [PINNED if t == PINNED else Target.parse(t, parse_variants(a.variant)) for t in a.targets]
        revs = {t.rev for t in a.targets if t != PINNED and t.rev} | ({a.router_commit} if a.router_commit else set())
        for rev in revs:
            resolve_commit(rev)
    except ValueError as e:
        p.error(str(e))
    return a


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request of the plan: its position, its group (document) and the prompt text."""

    index: int
    group: int
    text: str


def plan(a: argparse.Namespace) -> list[Prompt]:
    """The benchmark's shared-prefix plan (``workloads.shared_prefix``: G documents x Q questions, shuffled)."""
    w = shared_prefix(
        random.Random(f"llamacpp:shared_prefix:{a.seed}"),
        groups=a.groups,
        questions=a.questions,
        prefix_chars=a.prefix_chars,
    )
    out = []
    for r in w.requests:
        m = _GROUP.match(r.prompt)
        if m is None or not r.prompt.isascii():  # one ASCII character = one token of the tiny model
            raise ValueError(f"unexpected prompt {r.prompt[:40]!r}")
        out.append(Prompt(r.index, int(m.group(1)), r.prompt))
    return out


def lru_reference(
    prompts: Sequence[Prompt], *, engines: int, slots: int, placement: dict[int, int] | None = None
) -> float:
    """Cached share of a fleet where group g always goes to engine g mod ``engines``, one request at a time.

    ``placement`` (group -> engine index) replaces g mod ``engines``: the same reference for the placement a
    router actually chose.

    Each engine chooses slots as llama.cpp does (the idle slot whose cache shares the largest fraction of the
    prompt above ``SLOT_PROMPT_SIMILARITY``, else the least recently used) and reuses that slot's common prefix.
    Not an upper bound (a clairvoyant router could do better), but what an even, sticky partition gets from
    ``slots`` slots per engine: the gap between the oracle and this is eviction, not routing.
    """
    held: list[list[str]] = [[""] * slots for _ in range(engines)]
    used: list[list[int]] = [[-1 - s for s in range(slots)] for _ in range(engines)]
    cached = 0
    for t, p in enumerate(prompts):
        e = placement[p.group] if placement is not None else p.group % engines
        lcps = [common_prefix_len(p.text, h) for h in held[e]]
        best = max(range(slots), key=lambda s: lcps[s])
        if lcps[best] / len(p.text) <= SLOT_PROMPT_SIMILARITY:
            best = min(range(slots), key=lambda s: used[e][s])
        cached += min(lcps[best], len(p.text) - 1)
        held[e][best], used[e][best] = p.text, t
    return cached / sum(len(p.text) for p in prompts)


@dataclass(slots=True)
class Answer:
    """One request's outcome (times: ``perf_counter`` seconds)."""

    index: int
    replica: int
    sent: float = 0.0
    done: float = 0.0
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_ms: float | None = None
    worker: str | None = None
    error: str | None = None


async def _send(session: aiohttp.ClientSession, url: str, p: Prompt, out: Answer, max_tokens: int) -> None:
    body = {"model": MODEL_ID, "prompt": p.text, "max_tokens": max_tokens, "temperature": 0}
    out.sent = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            out.status = resp.status
            out.worker = resp.headers.get("x-smg-worker-id")
            text = await resp.text()
        if out.status != 200:
            out.error = f"HTTP {out.status}: {text[:200]}"
            return
        answer = json.loads(text)
        usage = answer["usage"]
        out.prompt_tokens = int(usage["prompt_tokens"])
        out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        timings = answer.get("timings") or {}
        out.prompt_ms = float(timings["prompt_ms"]) if "prompt_ms" in timings else None
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done = time.perf_counter()


async def drive(
    prompts: Sequence[Prompt],
    replicas: Sequence[str],
    *,
    concurrency: int,
    max_tokens: int,
    request_timeout: float,
    pinned: bool = False,
) -> list[Answer]:
    """Send every prompt in plan order, ``concurrency`` at a time, prompt ``i`` to replica ``i mod replicas``;
    ``pinned``: ``replicas`` are the engines, group ``g`` goes to engine ``g mod engines``, one at a time."""
    answers = [Answer(p.index, i % len(replicas)) for i, p in enumerate(prompts)]
    queue = iter(range(len(prompts)))
    turns: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
    client_timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(timeout=client_timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            for i in queue:
                p, out = prompts[i], answers[i]
                if not pinned:
                    await _send(session, replicas[out.replica], p, out, max_tokens)
                    continue
                out.replica = p.group % len(replicas)
                async with turns[p.group]:
                    await _send(session, replicas[out.replica], p, out, max_tokens)
                out.worker = replicas[out.replica]

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return answers


def engine_counters(engines: Sequence[LlamaServer]) -> list[dict[str, float]]:
    """Each engine's own prompt counters: tokens computed and tokens reused from a slot."""
    out = []
    for e in engines:
        with urllib.request.urlopen(e.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out.append(
            {
                "computed": metric_value(text, "llamacpp:prompt_tokens_total"),
                "cached": metric_value(text, "llamacpp:prompt_tokens_cached_total"),
            }
        )
    return out


def summarise(
    prompts: Sequence[Prompt], answers: Sequence[Answer], counters: list[dict[str, float]], *, slots: int
) -> dict[str, Any]:
    """Every figure of one cell, from the engines' answers (and their counters as a cross-check)."""
    by_index = {p.index: p for p in prompts}
    ok = [a for a in answers if a.error is None]
    prompt_tokens = sum(a.prompt_tokens for a in ok)
    cached = sum(a.cached_tokens for a in ok)
    sent = sorted(answers, key=lambda a: a.sent)
    oracle = oracle_cached((by_index[a.index].text, "") for a in sent)
    oracle_share = sum(oracle) / sum(len(by_index[a.index].text) for a in sent)
    share = cached / prompt_tokens if prompt_tokens else None
    prefill = [a.prompt_ms for a in ok if a.prompt_ms is not None]
    e2e = [(a.done - a.sent) * 1000.0 for a in ok]
    p50, p90 = percentile(prefill, 0.5), percentile(prefill, 0.9)
    engines_of: dict[int, set[str]] = defaultdict(set)
    for a in ok:
        if a.worker is not None:
            engines_of[by_index[a.index].group].add(a.worker)
    computed = [c["computed"] for c in counters]
    mean_computed = sum(computed) / len(computed) if computed else 0.0
    return {
        "requests": len(answers),
        "ok": len(ok),
        "errors": len(answers) - len(ok),
        "error_kinds": dict(Counter((a.error or "")[:80] for a in answers if a.error is not None)),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cached_share": share,
        "oracle_share": oracle_share,
        "cached_over_oracle": share / oracle_share if share is not None and oracle_share else None,
        "prompt_tokens_mismatches": sum(1 for a in ok if a.prompt_tokens != len(by_index[a.index].text)),
        "misses": sum(1 for a in ok if a.cached_tokens < len(by_index[a.index].text) // 2),
        "prefill_ms": {"p50": p50, "p90": p90, "max": max(prefill, default=None), "answers_with_timings": len(prefill)},
        "prefill_p90_over_p50": p90 / p50 if p50 and p90 is not None else None,
        "e2e_ms": {"p50": percentile(e2e, 0.5), "p90": percentile(e2e, 0.9), "p99": percentile(e2e, 0.99)},
        "engine_counters": counters,
        "engine_cached_tokens": sum(c["cached"] for c in counters),
        "prefill_work_max_over_mean": max(computed) / mean_computed if mean_computed else None,
        "engines_per_group": (sum(len(s) for s in engines_of.values()) / len(engines_of)) if engines_of else None,
        "groups_per_engine": _groups_per_engine(engines_of),
        "lru_reference_of_placement": _placement_reference(prompts, engines_of, slots=slots),
        "answers": [_record(a, by_index[a.index], t0=sent[0].sent) for a in sent],
    }


def _placement_reference(prompts: Sequence[Prompt], engines_of: dict[int, set[str]], *, slots: int) -> float | None:
    """``lru_reference`` of the router's own placement, when every group stayed on one engine (else None)."""
    if not engines_of or any(len(w) != 1 for w in engines_of.values()):
        return None
    ids = sorted({w for ws in engines_of.values() for w in ws})
    placement = {g: ids.index(next(iter(ws))) for g, ws in engines_of.items()}
    if set(placement) != {p.group for p in prompts}:
        return None
    return lru_reference(prompts, engines=len(ids), slots=slots, placement=placement)


def _groups_per_engine(engines_of: dict[int, set[str]]) -> dict[str, list[int]]:
    """The groups each engine served (from smg-router's ``x-smg-worker-id``; empty for the Rust smg)."""
    out: dict[str, list[int]] = defaultdict(list)
    for group, workers in sorted(engines_of.items()):
        for w in workers:
            out[w].append(group)
    return dict(sorted(out.items()))


def _record(a: Answer, p: Prompt, *, t0: float) -> dict[str, Any]:
    return {
        "index": a.index,
        "group": p.group,
        "replica": a.replica,
        "worker": a.worker,
        "sent_ms": round((a.sent - t0) * 1000.0, 1),
        "e2e_ms": round((a.done - a.sent) * 1000.0, 1),
        "prompt_tokens": a.prompt_tokens,
        "cached_tokens": a.cached_tokens,
        "prompt_ms": a.prompt_ms,
        "error": a.error,
    }


class Fleet:
    """The llama.cpp servers, restarted on the same addresses for every cell (cold slots, zeroed counters)."""

    def __init__(self, logs: Path, a: argparse.Namespace) -> None:
        self.logs, self.a = logs, a
        self.model = tiny_model()
        self.addresses: list[tuple[str, int]] = []
        self.servers: list[LlamaServer] = []

    def restart(self) -> list[LlamaServer]:
        self.stop()
        fresh = not self.addresses
        try:
            for i in range(self.a.engines):
                host, port = (next_host(), self.a.engine_port) if fresh else self.addresses[i]
                s = start_llama_server(
                    self.logs,
                    self.model,
                    host=host,
                    port=port or None,
                    slots=self.a.slots,
                    ctx=self.a.ctx,
                    threads=self.a.threads,
                )
                self.servers.append(s)
        except BaseException:
            self.stop()
            raise
        self.addresses = [(s.host, s.port) for s in self.servers]
        return self.servers

    def stop(self) -> None:
        stop_all(self.servers)
        self.servers = []


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| target | replicas | cached share | oracle | cached/oracle | LRU ref | prefill p50 ms | p90 ms | p90/p50 "
        "| e2e p50 ms | p99 ms | engines/group | LRU ref of its placement | errors |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        m = r["metrics"]
        lines.append(
            f"| {r['target']} | {r['replicas']} | {_f(m['cached_share'], '.3f')} | {m['oracle_share']:.3f} "
            f"| {_f(m['cached_over_oracle'], '.2f')} | {r['lru_reference']:.3f} "
            f"| {_f(m['prefill_ms']['p50'], '.0f')} | {_f(m['prefill_ms']['p90'], '.0f')} "
            f"| {_f(m['prefill_p90_over_p50'], '.1f')} | {_f(m['e2e_ms']['p50'], '.0f')} "
            f"| {_f(m['e2e_ms']['p99'], '.0f')} | {_f(m['engines_per_group'], '.2f')} "
            f"| {_f(m['lru_reference_of_placement'], '.3f')} | {m['errors']} |"
        )
    return "\n".join(lines)


def set_kv_capacity(router_url: str, tokens: int) -> None:
    """Tell one smg-router replica every worker's KV capacity, as an SMGWorker's ``kvCapacityTokens`` would."""
    status, body = http_json("GET", router_url + "/workers", timeout=5)
    if status != 200:
        raise RuntimeError(f"GET {router_url}/workers: {status}")
    for w in body["workers"]:
        status, got = http_json("PATCH", f"{router_url}/workers/{w['id']}", {"kv_capacity_tokens": tokens}, timeout=5)
        if status != 200:
            raise RuntimeError(f"PATCH {router_url}/workers/{w['id']}: {status} {got}")


def timed_drive(
    prompts: Sequence[Prompt], urls: Sequence[str], a: argparse.Namespace, *, pinned: bool = False
) -> tuple[list[Answer], float]:
    """``drive`` with the command's settings; its answers and wall seconds."""
    t0 = time.monotonic()
    answers = asyncio.run(
        drive(
            prompts,
            urls,
            concurrency=a.concurrency,
            max_tokens=a.max_tokens,
            request_timeout=a.request_timeout,
            pinned=pinned,
        )
    )
    return answers, time.monotonic() - t0


def run_pinned(fleet: Fleet, prompts: Sequence[Prompt], a: argparse.Namespace, reference: float) -> dict[str, Any]:
    """The ``pinned`` cell: the plan sent straight to fresh engines on the reference schedule."""
    engines = fleet.restart()
    answers, wall = timed_drive(prompts, [e.url for e in engines], a, pinned=True)
    metrics = summarise(prompts, answers, engine_counters(engines), slots=a.slots)
    pf = metrics["prefill_ms"]
    print(
        f"{PINNED}: cached {_f(metrics['cached_share'], '.3f')} (oracle {metrics['oracle_share']:.3f}) prefill"
        f" p50/p90 {_f(pf['p50'], '.0f')}/{_f(pf['p90'], '.0f')} ms errors {metrics['errors']} ({wall:.1f}s)",
        file=sys.stderr,
    )
    return {"target": PINNED, "replicas": 0, "wall_s": wall, "lru_reference": reference} | {
        "load_average": os.getloadavg(),
        "metrics": metrics,
        "decisions": {},
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    prompts = plan(a)
    reference = lru_reference(prompts, engines=a.engines, slots=a.slots)
    started = time.time()
    tmp = tempfile.TemporaryDirectory(prefix="routing-llamacpp-")
    code: dict[Target, TargetCode] = target_code([t for t in a.targets if t != PINNED], a.router_commit, Path(tmp.name))
    doc: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "head": _git("rev-parse", "HEAD"),
        "router_commit": resolve_commit(a.router_commit) if a.router_commit else "working tree",
        "target_commits": {t.name: c.commit or "working tree" for t, c in code.items()},
        "dirty": bool(_git("status", "--porcelain", "router")),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "load_average": os.getloadavg(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "targets"}
        | {"targets": [t if t == PINNED else t.name for t in a.targets]},
        "requests": len(prompts),
        "lru_reference": reference,
        "rows": [],
        "failures": [],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        doc["seconds"] = time.time() - started
        a.out.write_text(json.dumps(doc, indent=1))

    print(
        f"# shared_prefix on {a.engines} llama.cpp engines x {a.slots} slots ({a.ctx // a.slots} tokens each): "
        f"{a.groups} groups x {a.questions} questions of {a.prefix_chars}+ chars, {len(prompts)} requests, "
        f"{a.concurrency} clients; LRU reference {reference:.3f}",
        file=sys.stderr,
    )
    with tmp:
        logs = a.keep_logs or Path(tmp.name)
        logs.mkdir(parents=True, exist_ok=True)
        fleet = Fleet(logs, a)
        try:
            for replicas in a.replicas:
                for target in a.targets:
                    if target == PINNED:
                        if replicas == a.replicas[0]:  # no router: one cell, whatever the replicas
                            doc["rows"].append(run_pinned(fleet, prompts, a, reference))
                            save()
                        continue
                    cell = {"target": target.name, "replicas": replicas}
                    binary = {"rust": a.rust_bin, "vllm": a.vllm_bin}.get(target.kind)
                    if binary and not os.access(binary, os.X_OK):
                        print(f"skip {target.name}: no {binary}", file=sys.stderr)
                        continue
                    engines = fleet.restart()
                    head, dirty = _git("rev-parse", "HEAD"), bool(_git("status", "--porcelain", "router"))
                    launch = Launch(
                        target=target,
                        workers=[e.url for e in engines],
                        time_scale=1.0,
                        smg_args=a.router_arg,
                        rust_args=a.rust_arg,
                        rust_bin=a.rust_bin,
                        vllm_bin=a.vllm_bin,
                        router_pythonpath=code[target].pythonpath if target in code else None,
                    )
                    try:
                        routers = start_replicas(logs, launch, count=replicas, tag=f"llama-{target.name}-{replicas}")
                    except RuntimeError as e:
                        print(f"FAILED {cell}: {e}", file=sys.stderr)
                        doc["failures"].append({**cell, "error": str(e)[-2000:]})
                        save()
                        continue
                    if target.kind == "smg" and a.kv_capacity_tokens:
                        for r in routers:
                            set_kv_capacity(r.url, a.kv_capacity_tokens)
                    try:
                        answers, wall = timed_drive(prompts, [r.url for r in routers], a)
                        decisions = decision_counts(routers) if target.kind == "smg" else {}
                    finally:
                        stop_all(routers, kill=True)
                    metrics = summarise(prompts, answers, engine_counters(engines), slots=a.slots)
                    doc["rows"].append(
                        {**cell, "wall_s": wall, "lru_reference": reference, "load_average": os.getloadavg()}
                        | {"head": head, "router_dirty": dirty}
                        | ({"router_commit": code[target].commit or "working tree"} if target in code else {})
                        | {"metrics": metrics, "decisions": decisions}
                    )
                    save()
                    pf = metrics["prefill_ms"]
                    print(
                        f"{target.name} x{replicas}: cached {_f(metrics['cached_share'], '.3f')} "
                        f"(oracle {metrics['oracle_share']:.3f}, LRU ref {reference:.3f}) prefill p50/p90 "
                        f"{_f(pf['p50'], '.0f')}/{_f(pf['p90'], '.0f')} ms errors {metrics['errors']} ({wall:.1f}s)"
                        + (f" decisions {decisions}" if decisions else ""),
                        file=sys.stderr,
                    )
        finally:
            fleet.stop()
    save()
    print(markdown(doc["rows"]))
    for f in doc["failures"]:
        print(f"\nFAILED: {f['target']} x{f['replicas']}: {f['error'][-300:]}")
    print(f"\nJSON: {a.out}")
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
