"""The proxy benchmark's smg targets: ``smg:<policy>*N`` runs the router with ``--processes N``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from bench_proxy import main, parse_args, router_argv


def test_a_target_with_a_count_runs_that_many_processes_and_the_others_say_nothing_of_it() -> None:
    argv = router_argv("smg:round_robin*2", 9000, ["http://w"], "")
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--processes") + 1] == "2"
    plain = router_argv("smg:cache_aware", 9000, ["http://w"], "")
    assert "--processes" not in plain and plain[plain.index("--policy") + 1] == "cache_aware"
    both = router_argv("smg:cache_aware*3~x", 9000, ["http://w"], "", extra=["--max-retries", "1"])
    assert both[both.index("--processes") + 1] == "3" and both[-2:] == ["--max-retries", "1"]


def test_the_router_cores_default_to_the_core_under_test() -> None:
    assert parse_args([]).router_cores == "1"
    assert parse_args(["--router-cores", "0,1"]).router_cores == "0,1"


@pytest.mark.parametrize("target", ["smg:round_robin*", "smg:round_robin*two", "smg:*2"])
def test_a_malformed_count_is_refused(target: str) -> None:  # before anything runs (wrk or not)
    with pytest.raises(SystemExit, match="expected direct"):
        main(["--targets", target])
