"""Self-checks of the benchmark's pure parts (not in the default test run: ``pytest bench/routing``)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # fleet.py uses tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
from bounds import lru_placed, pooled_optimum
from capacity import CostModel, fleet_capacity
from fleet import Launch, Target
from oracle import common_prefix_len, oracle_cached
from workloads import MODEL, WORKLOADS, arrivals, build, sim_answer


def _naive_lcp(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_len_matches_a_character_loop() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(12)))
        assert common_prefix_len(a, b) == _naive_lcp(a, b), (a, b)


def test_oracle_matches_the_best_earlier_sequence_by_brute_force() -> None:
    rng = random.Random(4)
    for _ in range(200):
        seq = [
            ("".join(rng.choice("abc") for _ in range(rng.randrange(1, 10))), rng.choice(["", "a", "bc"]))
            for _ in range(rng.randrange(1, 12))
        ]
        want = [
            min(max((_naive_lcp(p, q + ans) for q, ans in seq[:i]), default=0), len(p) - 1)
            for i, (p, _) in enumerate(seq)
        ]
        assert oracle_cached(seq) == want, seq


def test_shared_prefix_oracle_is_every_request_but_each_groups_first_hitting_its_prefix() -> None:
    w = build("shared_prefix", 1)
    cached = oracle_cached((r.prompt, r.answer) for r in w.requests)
    first_of_group: set[str] = set()
    for r, c in zip(w.requests, cached, strict=True):
        head = r.prompt[:2000]
        if head in first_of_group:
            assert c >= 2000
        else:
            first_of_group.add(head)
            assert c < 2000
    assert len(first_of_group) == 12


def test_a_chat_turn_resends_the_previous_turn_and_its_answer() -> None:
    w = build("multi_turn", 1)
    by_index = {r.index: r for r in w.requests}
    follow_ups = [r for r in w.requests if r.after is not None]
    assert follow_ups
    for r in follow_ups:
        prev = by_index[r.after] if r.after is not None else None
        assert prev is not None and r.prompt.startswith(prev.prompt + prev.answer)
        assert prev.answer == sim_answer(prev.prompt, prev.max_tokens)


def test_every_request_of_a_plan_has_its_position_as_index() -> None:
    for name in WORKLOADS:
        assert [r.index for r in build(name, 1).requests] == list(range(len(build(name, 1).requests))), name


def test_arrivals_keep_the_mean_rate_with_or_without_bursts() -> None:
    for name in WORKLOADS:
        w = build(name, 1)
        spans = [arrivals(w, 10.0, random.Random(s))[-1] for s in range(200)]
        rate = len(w.requests) / (sum(spans) / len(spans))
        assert 9.0 < rate < 11.0, (name, rate)


def test_capacity_is_slower_cold_than_with_the_cache() -> None:
    cost = CostModel(kv_capacity=7000)
    cold = fleet_capacity(cost, workers=4, prompts=[2062], uncached=[2062], max_tokens=[16])
    warm = fleet_capacity(cost, workers=4, prompts=[2062], uncached=[62], max_tokens=[16])
    assert cost.batch(2078) == 3
    assert 6.0 < cold < 7.0 and warm > 4 * cold


def test_a_vllm_target_parses_with_events_and_a_variant_but_no_peers_or_commit() -> None:
    t = Target.parse("vllm:kv_aware+events~t", {"t": ["--router-temperature", "0.5"]})
    assert (t.kind, t.policy, t.events, t.peers, t.flags) == (
        "vllm",
        "kv_aware",
        True,
        False,
        ("--router-temperature", "0.5"),
    )
    assert t.name == "vllm:kv_aware+events~t"
    assert Target.parse("vllm:cache_aware") == Target("vllm", "cache_aware")
    for bad in (
        "vllm:cache_aware+peers",
        "vllm:cache_aware@HEAD",
        "rust:cache_aware+events",
        "vllm:",
        "tgi:cache_aware",
    ):
        with pytest.raises(ValueError, match="vllm:<policy>"):
            Target.parse(bad)


def test_a_vllm_replica_gets_its_own_metrics_port_and_with_events_every_workers_sources() -> None:
    workers = ["http://127.0.1.10:30000", "http://127.0.1.11:30000"]
    events = {w: (f"tcp://{w[7:17]}:1{i}", f"tcp://{w[7:17]}:2{i}") for i, w in enumerate(workers)}
    plain = Launch(
        target=Target.parse("vllm:cache_aware"),
        workers=workers,
        time_scale=0.25,
        vllm_bin="/x/vllm-router",
        vllm_args=["--cache-threshold", "0.5"],
        kv_events=events,
    ).argv(4000)
    assert plain[:7] == ["/x/vllm-router", "--host", "127.0.0.1", "--port", "4000", "--policy", "cache_aware"]
    assert plain[plain.index("--prometheus-host") + 1] == "127.0.0.1"
    assert int(plain[plain.index("--prometheus-port") + 1]) not in (0, 4000, 29000)
    assert plain[plain.index("--worker-urls") + 1 :][:2] == workers
    assert plain[-2:] == ["--cache-threshold", "0.5"]
    assert "--kv-event-source" not in plain  # events only for a +events target

    argv = Launch(target=Target.parse("vllm:kv_aware+events"), workers=workers, time_scale=0.25, kv_events=events).argv(
        4001
    )
    assert argv[argv.index("--kv-event-model") + 1] == MODEL
    sources = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"]
    replays = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-replay-source"]
    assert sources == [f"{w}={events[w][0]}" for w in workers]
    assert replays == [f"{w}={events[w][1]}" for w in workers]


def test_the_pooled_optimum_keeps_the_group_asked_again_soonest_and_lru_the_last_used() -> None:
    # room for 2 groups; each request is worth 1 when its group is held
    groups = ["a", "b", "c", "a", "b", "c", "a"]
    credit = [1] * len(groups)
    # Belady: at c (1st) keep a, b (asked at 3, 4) and skip c; then a, b hit; at c (2nd) drop b (never again): a hits
    assert pooled_optimum(groups, credit, 2) == 3
    # LRU on one worker of 2 evicts the group asked next every time: no hit at all
    assert lru_placed(groups, credit, 2, lambda _g: 0) == 0
    # a on worker 1 alone, b and c sharing worker 0: a hits twice
    assert lru_placed(groups, credit, 1, lambda g: 1 if g == "a" else 0) == 2
