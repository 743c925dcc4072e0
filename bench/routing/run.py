"""Routing-quality benchmark: simulated fleets with finite KV, 1-8 router replicas, Poisson load.

Usage (from the repository root, with the project's venv):
    .venv/bin/python bench/routing/run.py [--workload shared_prefix] [--targets smg:cache_aware,smg:round_robin,...]
        [--replicas 1,2,4,8] [--loads 0.6,0.8,0.95] [--workers 4] [--kv-capacity N] [--seed 1]
        [--time-scale 0.25] [--capacity-basis cold|oracle] [--router-arg=--flag=value ...] [--rust-arg=...]
        [--vllm-arg=...]
        [--router-commit REV] [--out results.json] [--plots DIR] [--quick]

For each workload, starts ``--workers`` smg-sim workers with finite KV (tokens = characters), then for every
cell (replicas x load x target, targets innermost so they run side by side) starts ``--replicas`` fresh router
processes in front of all the workers (fresh trees; the workers' caches are flushed), sends the workload's plan
with Poisson arrivals at ``load`` times the fleet's capacity (``capacity.py``: from the sim's cost model),
spreading requests over the replicas by client-side round robin, and reports per cell the cached-token share
the workers reported, the oracle (unbounded KV), TTFT p50/p90/p99, throughput, load spread and errors.
A target ``smg:...@REV`` (e.g. ``smg:cache_aware@HEAD~1``) runs smg-router of git revision REV, the others that of
``--router-commit`` or the working tree: before and after in one run.  See bench/routing/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from capacity import CostModel, fleet_capacity  # noqa: E402
from fleet import (  # noqa: E402
    VLLM_BIN,
    Launch,
    Target,
    TargetCode,
    decision_counts,
    kv_event_endpoints,
    parse_variants,
    resolve_commit,
    start_replicas,
    start_sims,
    stop_all,
    target_code,
    wait_for,
)
from loadgen import drive  # noqa: E402
from oracle import oracle_cached  # noqa: E402
from report import markdown, pivot, summarise  # noqa: E402
from support.procs import Sim, http_json  # noqa: E402
from workloads import MODEL, WORKLOADS, Workload, arrivals, build  # noqa: E402

DEFAULT_TARGETS = "smg:round_robin,smg:least_load,smg:cache_aware,rust:cache_aware,rust:round_robin"
RUST_BIN = "/tmp/smg-rust/bin/smg"


def _csv(kind: type[Any]) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload", type=_csv(str), default=["shared_prefix"], help=f"comma list of {', '.join(WORKLOADS)}"
    )
    p.add_argument(
        "--targets",
        type=_csv(str),
        default=DEFAULT_TARGETS.split(","),
        help="smg:<policy>[+peers][+events][~VARIANT][@REV] / rust:<policy>[~VARIANT]"
        " / vllm:<policy>[+events][~VARIANT]",
    )
    p.add_argument("--replicas", type=_csv(int), default=[1, 2, 4, 8])
    p.add_argument("--loads", type=_csv(float), default=[0.6, 0.8, 0.95], help="fractions of the fleet's capacity")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kv-capacity", type=int, default=None, help="KV tokens per worker (default: the workload's)")
    p.add_argument(
        "--max-running", type=int, default=None, help="running slots per worker (default: the workload's, 16 but wide)"
    )
    p.add_argument("--prefill-tps", type=float, default=4000.0)
    p.add_argument("--decode-step-ms", type=float, default=15.0)
    p.add_argument("--decode-step-ms-per-req", type=float, default=0.3)
    p.add_argument(
        "--cache-on",
        choices=("prefill", "schedule"),
        default="prefill",
        help="when the workers cache a prompt: after its prefill (SGLang) or when scheduled (vLLM); smg-sim --help",
    )
    p.add_argument("--groups", type=int, default=None, help="shared_prefix: prefix groups (default 12)")
    p.add_argument("--questions", type=int, default=None, help="shared_prefix: questions per group (default 10)")
    p.add_argument("--prefix-chars", type=int, default=None, help="shared_prefix: prefix length (default 2000)")
    p.add_argument("--capacity-basis", choices=("cold", "oracle"), default="cold", help="see capacity.py")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts and of the arrival times")
    p.add_argument(
        "--fleet-seed",
        type=int,
        default=0,
        help="seed of the workers' addresses (fleet.sim_address): the same seed, the same placement of every prefix",
    )
    p.add_argument("--time-scale", type=float, default=0.25, help="wall seconds per simulated second")
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for every smg-router (repeatable)")
    p.add_argument("--rust-arg", action="append", default=[], help="extra flag for every Rust smg (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra flag for every vLLM router (repeatable)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help='NAME="FLAGS": the flags of a target written TARGET~NAME (repeatable), e.g. a="--cache-threshold 0.5"',
    )
    p.add_argument("--rust-bin", default=RUST_BIN)
    p.add_argument("--vllm-bin", default=VLLM_BIN, help="vLLM's router, for the targets vllm:<policy>")
    p.add_argument(
        "--router-commit",
        default=None,
        help="run smg-router of this commit (git archive, first on PYTHONPATH) for every smg target without @REV",
    )
    p.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "out" / "routing" / "results.json", help="(git ignores bench/out)"
    )
    p.add_argument("--plots", type=Path, default=None, help="directory for PNG plots (default: beside --out)")
    p.add_argument("--keep-logs", type=Path, default=None, help="keep the processes' logs here")
    p.add_argument(
        "--quick",
        action="store_true",
        help="shared_prefix, 1-2 replicas, load 0.8, time scale 0.1; --targets default: smg cache_aware, round_robin",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.workload, a.replicas, a.loads, a.time_scale = (["shared_prefix"], [1, 2], [0.8], 0.1)
        if a.targets == DEFAULT_TARGETS.split(","):
            a.targets = ["smg:cache_aware", "smg:round_robin"]
    for w in a.workload:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    try:
        a.targets = [Target.parse(t, parse_variants(a.variant)) for t in a.targets]
        for rev in {t.rev for t in a.targets if t.rev} | ({a.router_commit} if a.router_commit else set()):
            resolve_commit(rev)
    except ValueError as e:
        p.error(str(e))
    return a


def _flush(sims: list[Sim]) -> None:
    """Empty every worker's prefix cache once it is idle, so each cell starts cold."""

    def idle() -> bool:
        for s in sims:
            status, body = http_json("GET", s.url + "/v1/loads", timeout=2)
            load = body["loads"][0]
            if status != 200 or load["num_running_reqs"] or load["num_waiting_reqs"]:
                return False
        return True

    wait_for(idle, timeout=120, what="idle workers")
    for s in sims:
        req = urllib.request.Request(s.url + "/flush_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()


def _capacity(workload: Workload, cost: CostModel, *, workers: int, basis: str) -> float:
    prompts = [len(r.prompt) for r in workload.requests]
    cached = oracle_cached((r.prompt, r.answer) for r in workload.requests) if basis == "oracle" else [0] * len(prompts)
    return fleet_capacity(
        cost,
        workers=workers,
        prompts=prompts,
        uncached=[p - c for p, c in zip(prompts, cached, strict=True)],
        max_tokens=[r.max_tokens for r in workload.requests],
    )


class Results:
    """The run's JSON, rewritten after every cell so an interrupted run keeps what it measured."""

    def __init__(self, a: argparse.Namespace, code: dict[Target, TargetCode]) -> None:
        self.path: Path = a.out
        self.started = time.time()
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "targets"}
        self.doc: dict[str, Any] = {
            "command": " ".join(sys.argv),
            "head": _git("rev-parse", "HEAD"),
            "router_commit": _git("rev-parse", a.router_commit) if a.router_commit else "working tree",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "settings": settings | {"targets": [t.name for t in a.targets]},
            "target_commits": {t.name: c.commit or "working tree" for t, c in code.items()},
            "workloads": {},
            "rows": [],
            "failures": [],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.doc["rows"]
        return rows

    def save(self) -> None:
        self.doc["seconds"] = time.time() - self.started
        self.path.write_text(json.dumps(self.doc, indent=1))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def run_workload(
    a: argparse.Namespace, name: str, logs: Path, code: dict[Target, TargetCode], results: Results
) -> None:
    """Every cell of workload ``name``: one fleet of workers, fresh routers per cell."""
    sizes = {"groups": a.groups, "questions": a.questions, "prefix_chars": a.prefix_chars}
    workload = build(name, a.seed, shared={k: v for k, v in sizes.items() if v is not None})
    cost = CostModel(
        prefill_tps=a.prefill_tps,
        decode_step_ms=a.decode_step_ms,
        decode_step_ms_per_req=a.decode_step_ms_per_req,
        max_running=a.max_running or workload.max_running,
        kv_capacity=a.kv_capacity or workload.kv_capacity,
        cache_on=a.cache_on,
    )
    capacity = _capacity(workload, cost, workers=a.workers, basis=a.capacity_basis)
    plan_oracle = oracle_cached((r.prompt, r.answer) for r in workload.requests)
    plan_share = sum(plan_oracle) / sum(len(r.prompt) for r in workload.requests)
    results.doc["workloads"][name] = {
        "description": workload.description,
        "requests": len(workload.requests),
        "workers": a.workers,
        "cost_model": asdict(cost),
        "capacity_basis": a.capacity_basis,
        "capacity_rps": capacity,
        "plan_oracle_share": plan_share,
    }
    print(
        f"# {name}: {workload.description}; {len(workload.requests)} requests, {a.workers} workers x "
        f"{cost.kv_capacity} KV tokens; capacity ({a.capacity_basis}) {capacity:.2f} req/s simulated; "
        f"oracle {plan_share:.3f}",
        file=sys.stderr,
    )
    events = any(t.events for t in a.targets)
    sims = start_sims(
        logs, count=a.workers, cost=cost, time_scale=a.time_scale, fleet_seed=a.fleet_seed, kv_events=events
    )
    try:
        workers = [s.url for s in sims]
        endpoints = kv_event_endpoints(sims) if events else {}
        for replicas in a.replicas:
            for load in a.loads:
                rng = random.Random(f"arrivals:{a.seed}:{name}:{load}")
                offsets = [t * a.time_scale for t in arrivals(workload, load * capacity, rng)]
                for target in a.targets:
                    binary = {"rust": a.rust_bin, "vllm": a.vllm_bin}.get(target.kind)
                    if binary and not os.access(binary, os.X_OK):
                        print(f"skip {target.name}: no {binary}", file=sys.stderr)
                        continue
                    cell = {"workload": name, "target": target.name, "replicas": replicas, "load": load}
                    launch = Launch(
                        target=target,
                        workers=workers,
                        time_scale=a.time_scale,
                        smg_args=a.router_arg,
                        rust_args=a.rust_arg,
                        rust_bin=a.rust_bin,
                        vllm_args=a.vllm_arg,
                        vllm_bin=a.vllm_bin,
                        router_pythonpath=code[target].pythonpath if target in code else None,
                        kv_events=endpoints,
                    )
                    _flush(sims)
                    try:
                        routers = start_replicas(logs, launch, count=replicas, tag=f"{name}-{target.name}-{replicas}")
                    except RuntimeError as e:
                        print(f"FAILED {cell}: {e}", file=sys.stderr)
                        results.doc["failures"].append({**cell, "error": str(e)[-2000:]})
                        results.save()
                        continue
                    try:
                        t0 = time.monotonic()
                        outcomes, samples, _ = asyncio.run(
                            drive(
                                workload.requests,
                                offsets,
                                replicas=[r.url for r in routers],
                                workers=workers,
                                model=MODEL,
                                sample_interval=max(0.02, 0.25 * a.time_scale),
                            )
                        )
                        wall = time.monotonic() - t0
                        decisions = decision_counts(routers) if target.kind == "smg" else None
                    finally:
                        stop_all(routers, kill=True)
                    metrics = summarise(
                        workload.requests, outcomes, samples, time_scale=a.time_scale, workers=a.workers
                    )
                    metrics["router_decisions"] = decisions
                    commit = {"router_commit": code[target].commit or "working tree"} if target in code else {}
                    results.rows.append(
                        {**cell, "offered_rps": load * capacity, "wall_s": wall, **commit, "metrics": metrics}
                    )
                    results.save()
                    t = metrics["ttft_ms"]
                    print(
                        f"{name} {target.name} x{replicas} load {load:.2f}: cached {metrics['cached_share'] or 0:.3f} "
                        f"(oracle {metrics['oracle_share']:.3f}) ttft p50/p99 {t['p50'] or 0:.0f}/{t['p99'] or 0:.0f}"
                        f" spread {metrics['load']['running_max_over_mean'] or 0:.2f} errors {metrics['errors']}"
                        f" workers/group {metrics['workers_per_prefix'] or 0:.2f}"
                        f" served {metrics['requests_per_worker']}"
                        f" decisions {decisions} ({wall:.1f}s)",
                        file=sys.stderr,
                    )
    finally:
        stop_all(sims)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        code = target_code(a.targets, a.router_commit, Path(tmp))
        results = Results(a, code)
        logs = a.keep_logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for name in a.workload:
            run_workload(a, name, logs, code, results)
    results.save()
    print(markdown(results.rows))
    print(pivot(results.rows))
    for f in results.doc["failures"]:
        print(f"\nFAILED: {f['workload']} {f['target']} x{f['replicas']} load {f['load']}: {f['error'][-300:]}")
    print(f"\nJSON: {a.out}")
    try:
        from plot import plot_all
    except ImportError as e:
        print(f"no plots ({e}); install matplotlib to get them", file=sys.stderr)
    else:
        for path in plot_all(results.doc, a.plots or a.out.parent):
            print(f"plot: {path}")
    return 1 if results.doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
