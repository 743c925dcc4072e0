"""smg-operator's leadership flags: client-go's defaults, their SMG_OPERATOR_* variables, and the timing
invariant (renew deadline + call timeout <= lease duration) refused at start rather than discovered in an
outage."""

from __future__ import annotations

import pytest
from smg_operator.settings import parse_settings

ELECTION = ["--leader-election", "--leader-election-namespace", "smg"]


def test_the_defaults_are_client_gos_with_a_5s_timeout_on_every_api_call() -> None:
    s = parse_settings(ELECTION)
    assert (s.lease_duration, s.leader_election_renew_deadline, s.leader_election_retry_period) == (15, 10, 2)
    assert s.kube_request_timeout == 5


def test_every_leadership_flag_has_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMG_OPERATOR_LEADER_ELECTION_RENEW_DEADLINE", "4")
    monkeypatch.setenv("SMG_OPERATOR_LEADER_ELECTION_RETRY_PERIOD", "1")
    monkeypatch.setenv("SMG_OPERATOR_KUBE_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("SMG_OPERATOR_LEADER_ELECTION_LEASE_DURATION", "6")
    s = parse_settings([*ELECTION, "--router-timeout", "2"])
    assert (s.lease_duration, s.leader_election_renew_deadline, s.leader_election_retry_period) == (6, 4, 1)
    assert s.kube_request_timeout == 2


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--leader-election-renew-deadline", "15"], "shorter than the lease duration"),
        (["--kube-request-timeout", "6"], "must not exceed the lease duration"),
        (["--router-timeout", "6"], "must not exceed the lease duration"),  # router calls are bounded the same way
        (["--leader-election-retry-period", "10"], "retry period"),
        (["--kube-request-timeout", "0"], "must be positive"),
    ],
)
def test_unsound_timings_stop_the_operator_at_start(
    flags: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        parse_settings([*ELECTION, *flags])
    assert exit.value.code == 2
    assert complaint in capsys.readouterr().err


def test_without_election_the_lease_timings_are_not_checked_but_the_request_timeout_is() -> None:
    assert parse_settings(["--leader-election-renew-deadline", "99"]).leader_election_renew_deadline == 99
    with pytest.raises(SystemExit):
        parse_settings(["--kube-request-timeout", "-1"])
