"""What the index of the engines' KV events costs: events applied per second, CPU per 1k events, its bytes against
its budget, and one lookup of a long prompt.

Usage (from the repository root, with the project's venv):
    .venv/bin/python bench/kv_index.py [--blocks 10000000] [--workers 8] [--block-size 16]
        [--budget-bytes 268435456] [--prompt-tokens 4096] [--out bench/out/kv_index.json]

Feeds ``--blocks`` stored blocks to ``tree.blocks.BlockIndex`` as engines send them (prompts of 64 blocks, each
engine event storing 16 of them after its parent, spread over ``--workers`` workers; a tenth of them later removed
again), then times ``match`` of a ``--prompt-tokens`` prompt that a worker holds whole.  It measures the index
alone: decoding the engines' msgpack is ``kv_events.decode`` (about 2.3 ms per 1k events, its tests' figure).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "router"))

from smg_router.tree.blocks import BlockIndex  # noqa: E402

PROMPT_BLOCKS = 64
EVENT_BLOCKS = 16


def run(blocks: int, workers: int, block_size: int, budget: int, prompt_tokens: int) -> dict[str, object]:
    index = BlockIndex(budget_bytes=budget)
    rng = random.Random(1)
    events = 0
    stored = 0
    names = [f"http://10.0.0.{i}:8000" for i in range(workers)]
    removals: list[tuple[str, list[int]]] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    prompt = 0
    while stored < blocks:
        worker = names[prompt % workers]
        base = rng.getrandbits(40)
        tokens = [base + i for i in range(PROMPT_BLOCKS * block_size)]
        parent = None
        for first in range(0, PROMPT_BLOCKS, EVENT_BLOCKS):
            hashes = [(prompt << 8) | (first + i) for i in range(EVENT_BLOCKS)]
            index.stored(
                worker,
                hashes=hashes,
                parent=parent,
                tokens=tokens[first * block_size : (first + EVENT_BLOCKS) * block_size],
                block_size=block_size,
            )
            parent = hashes[-1]
            events += 1
            stored += EVENT_BLOCKS
            if rng.random() < 0.1:
                removals.append((worker, hashes[-4:]))
        prompt += 1
    for worker, hashes in removals:
        index.removed(worker, hashes)
        events += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    held = [rng.getrandbits(40) + i for i in range(prompt_tokens)]
    step = 256
    parent = None
    for first in range(0, prompt_tokens // block_size, step // block_size):
        hashes = [("held", first + i) for i in range(step // block_size)]
        index.stored(
            names[0],
            hashes=hashes,
            parent=parent,
            tokens=held[first * block_size : first * block_size + step],
            block_size=block_size,
        )
        parent = hashes[-1]
    rounds = 200
    t0 = time.perf_counter()
    for _ in range(rounds):
        found = index.match(held)
    lookup_us = (time.perf_counter() - t0) / rounds * 1e6
    assert found.get(names[0], 0) >= prompt_tokens - block_size, found
    return {
        "blocks_fed": stored,
        "events": events,
        "events_per_s": round(events / wall),
        "blocks_per_s": round(stored / wall),
        "cpu_ms_per_1k_events": round(cpu / events * 1e6, 1),
        "index_bytes": index.estimated_bytes(),
        "budget_bytes": budget,
        "blocks_forgotten": index.forgotten,
        "lookup_us": round(lookup_us, 1),
        "prompt_tokens": prompt_tokens,
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10_000_000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget-bytes", type=int, default=256 * 2**20)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    result = {
        "command": " ".join(["bench/kv_index.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        **run(a.blocks, a.workers, a.block_size, a.budget_bytes, a.prompt_tokens),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
