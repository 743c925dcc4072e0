"""``--epp-port``, ``--epp-health-port``, ``--epp-fallbacks``: off by default, checked when given."""

from __future__ import annotations

import pytest
from smg_router.settings import parse_settings


def test_the_endpoint_picker_is_off_by_default_and_on_with_its_ports() -> None:
    assert not parse_settings([]).epp.enabled
    epp = parse_settings(["--epp-port", "9002", "--epp-health-port", "9003", "--epp-fallbacks", "2"]).epp
    assert (epp.enabled, epp.port, epp.health_port, epp.fallbacks) == (True, 9002, 9003, 2)


def test_the_environment_sets_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMG_EPP_PORT", "9002")
    monkeypatch.setenv("SMG_EPP_HEALTH_PORT", "9003")
    epp = parse_settings([]).epp
    assert (epp.port, epp.health_port) == (9002, 9003)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epp-port", "30000"], "--epp-port must be a port number other than --port"),
        (["--epp-port", "70000"], "--epp-port must be a port number"),
        (["--epp-health-port", "9003"], "--epp-health-port needs --epp-port"),
        (["--epp-port", "9002", "--epp-health-port", "9002"], "--epp-health-port needs --epp-port, and another port"),
        (["--epp-port", "9002", "--epp-fallbacks", "-1"], "--epp-fallbacks must be from 0 to 16"),
    ],
)
def test_bad_values_are_refused_by_name(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(argv)
    assert message in capsys.readouterr().err
