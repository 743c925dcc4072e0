"""The app's background tasks start with it and never outlive it."""

from __future__ import annotations

import asyncio

import pytest
from smg_router.app import running
from smg_router.settings import parse_settings
from support.procs import free_port


def _smg_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("smg-") and not t.done()}


async def test_background_tasks_stop_with_the_app() -> None:
    port = free_port()
    async with running(parse_settings(["--port", str(port), "--worker-urls", "http://127.0.0.1:9"])) as (_, server):
        await server.listen("127.0.0.1", port)
        assert _smg_tasks() == {
            *("smg-health-checker", "smg-load-monitor", "smg-tree-eviction", "smg-loop-lag"),
            "smg-http-keepalive",  # the server's idle-connection sweeper
        }
    await asyncio.sleep(0)
    assert _smg_tasks() == set()


def test_environment_sets_every_flag(monkeypatch) -> None:
    monkeypatch.setenv("SMG_CACHE_THRESHOLD", "0.6")
    monkeypatch.setenv("SMG_POLICY", "CacheAware")
    monkeypatch.setenv("SMG_BALANCE_REL_THRESHOLD", "9")
    monkeypatch.setenv("SMG_WORKER_URLS", "http://127.0.0.2:8000, http://127.0.0.3:8000")
    monkeypatch.setenv("SMG_ADMIN_API_KEY", "k")
    s = parse_settings([])
    assert s.policy.cache_threshold == 0.6 and s.policy.name == "cache_aware"
    assert s.policy.balance_rel_threshold == 9 and s.server.admin_api_key == "k"
    assert s.worker_urls == ("http://127.0.0.2:8000", "http://127.0.0.3:8000")
    # the command line wins over the environment
    assert parse_settings(["--cache-threshold", "0.1"]).policy.cache_threshold == 0.1


def test_bad_worker_urls_on_the_command_line_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--worker-urls", "localhost:8000"],
        ["--pd-disaggregation", "--decode", "ftp://x"],
        ["--pd-disaggregation", "--prefill", "http://127.0.0.2:8000", "port"],
    ):
        with pytest.raises(SystemExit) as exc:
            parse_settings(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "localhost:8000" in err and "ftp://x" in err and "bootstrap port 'port'" in err
