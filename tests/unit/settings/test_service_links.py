"""Kubernetes service links (``<SERVICE>_PORT=tcp://ip:port`` and friends, one set per Service in the namespace)
must never be read as settings: the chart's ``smg-operator-metrics`` Service once crash-looped the operator."""

from __future__ import annotations

import re

import pytest
from smg_operator.settings import parse_settings as parse_operator
from smg_router.settings import build_parser
from smg_router.settings import parse_settings as parse_router

# every name Kubernetes derives from a Service <S> (its name upper-cased, '-' -> '_'):
#   <S>_SERVICE_HOST, <S>_SERVICE_PORT, <S>_SERVICE_PORT_<PORTNAME>, <S>_PORT,
#   <S>_PORT_<N>_<PROTO>, <S>_PORT_<N>_<PROTO>_{PROTO,PORT,ADDR}
_LINK_NAMES = re.compile(r".+_(SERVICE_HOST|SERVICE_PORT(_.+)?|PORT_[0-9]+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)")


def _router_env_names() -> list[str]:
    return ["SMG_" + a.dest.upper() for a in build_parser()._actions if a.dest != "help"]


def test_no_router_setting_is_named_like_a_service_link_other_than_port() -> None:
    clashes = [n for n in _router_env_names() if _LINK_NAMES.fullmatch(n)]
    assert clashes == []


def test_router_ignores_a_service_link_in_its_port_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMG_PORT", "tcp://10.96.0.7:30000")  # a Service named "smg"
    assert parse_router([]).server.port == 30000
    monkeypatch.setenv("SMG_PORT", "31000")
    assert parse_router([]).server.port == 31000


def test_operator_ignores_the_service_link_of_its_own_metrics_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMG_OPERATOR_METRICS_PORT", "tcp://10.96.0.84:8080")  # Service smg-operator-metrics
    monkeypatch.setenv("SMG_OPERATOR_ROUTER_PORT", "tcp://10.96.0.85:30000")  # Service smg-operator-router
    s = parse_operator([])
    assert (s.metrics_port, s.router_port) == (8080, 30000)
    monkeypatch.setenv("SMG_OPERATOR_METRICS_PORT", "9090")
    assert parse_operator([]).metrics_port == 9090
