#!/usr/bin/env python3
"""How much of a workload's prompts engines of the workload's KV capacity could serve from cache, beside the oracle.

The oracle (``oracle.py``) has unbounded KV: when a workload's prefixes outgrow the fleet's KV, no router reaches
it.  For the workloads made of groups (a prefix, then ``\\n\\n`` and a question: shared_prefix, long, zipf, wide,
bursty's bursts), this replays the plan one request at a time and counts a request's oracle tokens as cached
only when its group's prefix is still held:

- ``pooled optimum``: one cache of the whole fleet's KV that keeps the groups asked again soonest (Belady's
  rule); no placement over the workers, and no eviction order, does better;
- ``LRU, pooled``: one LRU cache of the whole fleet's KV: LRU engines with each new group placed where what it
  evicts was used longest ago, the best such engines reach without knowing which groups will be asked again;
- ``LRU, by popularity``: each worker an LRU cache of its own KV (as the engines evict), the most requested
  groups (known in advance) fixed on all workers but one, the others sharing that one;
- ``LRU, hashed``: the same engines, each group on a worker drawn at random (as a hash places it), the mean of
  ``--draws`` draws.

A group's footprint is its longest prompt and answer.  Requests in flight together, and the KV they hold while
they run, are ignored: every bound is an upper one.

    bench/routing/bounds.py --workload zipf,shared_prefix --seed 1,2,3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import oracle_cached
from workloads import WORKLOADS, build

WORKERS = 4
"""The routing benchmark's fleet (``run.py --workers``)."""


def _groups(prompts: Sequence[str]) -> list[str | None]:
    """Each prompt's group (the text before its first blank line); None for a prompt without one."""
    return [p.split("\n\n", 1)[0] if "\n\n" in p else None for p in prompts]


def _replay(groups: Sequence[str | None], credit: Sequence[int], held: Callable[[int, str], bool]) -> int:
    """Cached tokens: each request's oracle credit when ``held(i, group)`` says its group is cached."""
    return sum(c for i, (g, c) in enumerate(zip(groups, credit, strict=True)) if g is not None and held(i, g))


def pooled_optimum(groups: Sequence[str | None], credit: Sequence[int], room: int) -> int:
    """Belady over ``room`` groups: on a miss, of the cached groups and the new one, the one asked again last goes."""
    following: dict[int, int] = {}
    last: dict[str, int] = {}
    for i in range(len(groups) - 1, -1, -1):
        g = groups[i]
        if g is not None:
            following[i] = last.get(g, len(groups))
            last[g] = i
    cache: dict[str, int] = {}  # group -> the index of its next request

    def held(i: int, g: str) -> bool:
        hit = g in cache
        cache[g] = following[i]
        if len(cache) > room:
            del cache[max(cache, key=cache.__getitem__)]
        return hit

    return _replay(groups, credit, held)


def lru_placed(groups: Sequence[str | None], credit: Sequence[int], room: int, place: Callable[[str], int]) -> int:
    """One LRU cache of ``room`` groups per worker; group ``g`` always on worker ``place(g)``."""
    caches = [OrderedDict[str, None]() for _ in range(WORKERS)]

    def held(_i: int, g: str) -> bool:
        cache = caches[place(g)]
        hit = g in cache
        cache[g] = None
        cache.move_to_end(g)
        if len(cache) > room:
            cache.popitem(last=False)
        return hit

    return _replay(groups, credit, held)


def bounds(name: str, seed: int, draws: int) -> dict[str, float] | None:
    workload = build(name, seed)
    prompts = [r.prompt for r in workload.requests]
    groups = _groups(prompts)
    if not any(groups):
        return None
    credit = oracle_cached((r.prompt, r.answer) for r in workload.requests)
    total = sum(len(p) for p in prompts)
    footprint = max(len(r.prompt) + len(r.answer) for r in workload.requests if "\n\n" in r.prompt)
    room = max(1, workload.kv_capacity // footprint)  # groups one worker holds
    asked = [g for g, _ in Counter(g for g in groups if g is not None).most_common()]
    fixed = {g: i // room for i, g in enumerate(asked[: room * (WORKERS - 1)])}
    rng = random.Random(f"bounds:{name}:{seed}")
    hashed = []
    for _ in range(draws):
        spot = {g: rng.randrange(WORKERS) for g in asked}
        hashed.append(lru_placed(groups, credit, room, spot.__getitem__))
    return {
        "oracle": sum(credit) / total,
        "pooled optimum": pooled_optimum(groups, credit, room * WORKERS) / total,
        "LRU, pooled": lru_placed(groups, credit, room * WORKERS, lambda _g: 0) / total,
        "LRU, by popularity": lru_placed(groups, credit, room, lambda g: fixed.get(g, WORKERS - 1)) / total,
        "LRU, hashed": statistics.mean(hashed) / total,
        "groups": len(asked),
        "groups per worker": room,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="zipf", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--seed", default="1", help="comma list of plan seeds (run.py --seed)")
    p.add_argument("--draws", type=int, default=30, help="random placements for 'LRU, hashed'")
    a = p.parse_args(argv)
    for name in a.workload.split(","):
        for seed in (int(s) for s in a.seed.split(",")):
            found = bounds(name, seed, a.draws)
            if found is None:
                print(f"{name} seed {seed}: no groups")
                continue
            print(
                f"{name} seed {seed}: "
                + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in found.items())
            )


if __name__ == "__main__":
    main()
