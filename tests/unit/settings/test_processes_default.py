"""``--processes``: its default is the container's CPU limit (cgroup v2 ``cpu.max``), rounded up; 1 without one."""

from __future__ import annotations

from pathlib import Path

import pytest
from smg_router.settings import cpu_limit, default_processes, parse_settings


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("max 100000\n", None),  # no limit
        ("max\n", None),
        ("200000 100000\n", 2),
        ("150000 100000\n", 2),  # 1.5 cores: rounded up
        ("100001 100000", 2),
        ("50000 100000\n", 1),  # half a core: still one process
        ("1000 100000\n", 1),
        ("400000 50000\n", 8),  # another period
        ("300000\n", 3),  # a quota alone: the default period
        ("", None),
        ("garbage 100000\n", None),
        ("100000 0\n", None),
        ("-1 100000\n", None),
        ("1 2 3\n", None),
    ],
)
def test_cpu_max_gives_whole_cores(text: str, cores: int | None) -> None:
    assert cpu_limit(text) == cores


def test_the_default_reads_the_file_and_is_1_without_a_limit_or_a_file(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("250000 100000\n")
    assert default_processes(str(cpu_max)) == 3
    cpu_max.write_text("max 100000\n")
    assert default_processes(str(cpu_max)) == 1
    assert default_processes(str(tmp_path / "absent")) == 1  # outside a container (cgroup v1, no cgroupfs)


def test_the_flag_and_the_environment_set_it_and_a_child_holds_its_share_of_the_memory_budgets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SMG_PROCESSES", "3")
    assert parse_settings([]).process.count == 3
    assert parse_settings(["--processes", "2"]).process.count == 2
    parent = parse_settings(["--processes", "4", "--tree-memory-budget", "400"])
    assert parent.process.parent and not parent.process.child and parent.policy.tree_memory_budget == 400
    child = parse_settings(["--processes", "4", "--tree-memory-budget", "400", "--process-index", "3"])
    assert child.process.child and not child.process.parent and child.process.index == 3
    assert child.policy.tree_memory_budget == 100
    assert child.server.max_inflight_bytes == max(child.server.max_payload_size, parent.server.max_inflight_bytes // 4)
    one = parse_settings(["--processes", "1"])
    assert not one.process.parent and not one.process.child


@pytest.mark.parametrize("argv", [["--processes", "0"], ["--processes", "2", "--process-index", "2"]])
def test_a_bad_count_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(argv)
    assert "--process" in capsys.readouterr().err
