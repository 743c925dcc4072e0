"""Command line and environment → OperatorSettings (every flag --x-y is also SMG_OPERATOR_X_Y)."""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from smg_operator.inference_pools import MODES
from smg_operator.leadership import LeaseTiming
from smg_operator.tenancy import (
    DEFAULT_ENDPOINT_RULES,
    DEFAULT_ENDPOINTS,
    EndpointAllowList,
    RuleError,
    ServiceRef,
    default_router_services,
    parse_service_ref,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty means the whole cluster."""
    reconcile_interval: float = 10.0
    """Seconds between level-triggered reconciles of each SMGWorker (events trigger one sooner)."""
    router_service: str | None = None
    """Router Service for SMGWorkers that do not name one in spec.router."""
    router_namespace: str | None = None
    """Namespace of that Service (--router-namespace, else the operator's own POD_NAMESPACE); None means the
    SMGWorker's own."""
    router_port: int = 30000
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8080
    """Serves /metrics and /healthz; 0 disables."""
    admin_api_key: str | None = None
    """The router's admin token (SMG_ADMIN_API_KEY, the variable the router reads)."""
    leader_election: bool = False
    leader_election_namespace: str | None = None
    lease_duration: int = 15
    """Seconds a standby waits, after it last saw the Lease change, before it takes the Lease."""
    router_timeout: float = 5.0
    log_level: str = "info"
    # -- leadership (leadership.py): client-go's timings and the API call timeout they are sized with
    leader_election_renew_deadline: float = 10.0
    """Seconds the leader keeps leading without a successful renewal; shorter than the lease duration."""
    leader_election_retry_period: float = 2.0
    """Seconds between renewals (leader) and between tries (standby)."""
    kube_request_timeout: float = 5.0
    """Bound of every Kubernetes API call the operator makes itself (status, Events, the Lease)."""
    # -- tenancy (tenancy.py): where the admin token may go and what may be registered
    allowed_router_services: frozenset[ServiceRef] = frozenset()
    """(namespace, name) of the router Services an SMGWorker may target: --allowed-router-service, else the
    default router alone (--router-service in router_namespace); empty refuses every router."""
    allowed_endpoints: EndpointAllowList = DEFAULT_ENDPOINTS
    """What static spec.endpoints may name: --allowed-endpoint, else tenancy.DEFAULT_ENDPOINT_RULES."""
    # -- the InferencePool source (inference_pools.py, pool_sync.py)
    inference_pools: str = "off"
    """Which InferencePools (inference.networking.k8s.io/v1) become workers of the default router: ``off`` (none;
    the CRD may be absent), ``annotated`` (those annotated smg.dev/router: <router_service>) or ``all``."""


def _env(flag: str, default: str) -> str:
    """The value of ``SMG_OPERATOR_<FLAG>``, or the flag's default when it is unset."""
    value = _env_or_none(flag)
    return default if value is None else value


SERVICE_LINK = re.compile(r"(tcp|udp|sctp)://\S+:[0-9]+")
"""The value Kubernetes gives ``<SERVICE>_PORT`` for every Service in the namespace (service links): the chart's
Service ``smg-operator-metrics`` sets ``SMG_OPERATOR_METRICS_PORT=tcp://10.96.0.84:8080``.  No setting takes such
a value, so one is a collision, not a setting, and is ignored."""


def _env_or_none(flag: str) -> str | None:
    var = "SMG_OPERATOR_" + flag.upper().replace("-", "_")
    raw = os.environ.get(var)
    if raw is not None and SERVICE_LINK.fullmatch(raw):
        logging.getLogger(__name__).warning(
            "ignoring %s=%s: a Kubernetes service link, not a setting (set enableServiceLinks: false)", var, raw
        )
        return None
    return raw


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``smg-operator`` (docs/flags.md lists them; tests/unit/architecture/test_stability_contract.py
    keeps the two equal)."""
    p = argparse.ArgumentParser(
        prog="smg-operator",
        description="Registers SMGWorker pools with every SMG router "
        "replica. Flags --x-y can also be set as SMG_OPERATOR_X_Y.",
    )
    p.add_argument(
        "--namespace", action="append", default=None, help="namespace to watch (repeat; default: the whole cluster)"
    )
    p.add_argument("--reconcile-interval", type=float, default=float(_env("reconcile-interval", "10")))
    p.add_argument("--router-service", default=_env_or_none("router-service"), help="default router Service name")
    p.add_argument("--router-namespace", default=_env_or_none("router-namespace"), help="its namespace")
    p.add_argument("--router-port", type=int, default=int(_env("router-port", "30000")))
    p.add_argument("--metrics-host", default=_env("metrics-host", "0.0.0.0"))
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(_env("metrics-port", "8080")),
        help="port of /metrics and /healthz (0: off)",
    )
    p.add_argument(
        "--leader-election", action="store_true", default=_env("leader-election", "").lower() in ("1", "true", "yes")
    )
    p.add_argument("--leader-election-namespace", default=_env_or_none("leader-election-namespace"))
    p.add_argument(
        "--leader-election-lease-duration",
        type=int,
        default=int(_env("leader-election-lease-duration", "15")),
        help="seconds (default 15)",
    )
    p.add_argument("--router-timeout", type=float, default=float(_env("router-timeout", "5")))
    p.add_argument("--log-level", default=_env("log-level", "info"))
    p.add_argument(
        "--inference-pools",
        choices=MODES,
        default=_env("inference-pools", "off"),
        help="register the READY pods x targetPorts of Gateway API Inference Extension InferencePools on every "
        "replica of --router-service: 'annotated' takes the pools annotated smg.dev/router: <--router-service>, "
        "'all' every pool in the watched namespaces; the model comes from the pool's smg.dev/model annotation "
        "(default: off; needs get/list/watch on inferencepools)",
    )
    _leadership_flags(p)
    _tenancy_flags(p)
    return p


def parse_settings(argv: Sequence[str] | None = None) -> OperatorSettings:
    p = build_parser()
    ns_env = _env("namespace", "")
    a = p.parse_args(argv)
    if a.inference_pools not in MODES:  # from the environment: argparse checks choices on the command line only
        p.error(f"--inference-pools must be one of {', '.join(MODES)}, not {a.inference_pools!r}")
    if a.inference_pools != "off" and not a.router_service:
        p.error("--inference-pools needs --router-service: a pool's workers go to the operator's own router")
    if a.reconcile_interval <= 0:
        p.error("--reconcile-interval must be positive")
    namespaces = tuple(a.namespace or [n.strip() for n in ns_env.split(",") if n.strip()])
    if a.leader_election and not (a.leader_election_namespace or namespaces or os.environ.get("POD_NAMESPACE")):
        p.error("--leader-election needs --leader-election-namespace (or POD_NAMESPACE)")
    _check_leadership(p, a)
    router_namespace = a.router_namespace or os.environ.get("POD_NAMESPACE") or None
    allowed_routers, allowed_endpoints = _tenancy(p, a, router_namespace=router_namespace)
    return OperatorSettings(
        namespaces=namespaces,
        reconcile_interval=a.reconcile_interval,
        router_service=a.router_service,
        router_namespace=router_namespace,
        router_port=a.router_port,
        metrics_host=a.metrics_host,
        metrics_port=a.metrics_port,
        admin_api_key=os.environ.get("SMG_ADMIN_API_KEY") or None,
        leader_election=a.leader_election,
        leader_election_namespace=a.leader_election_namespace
        or os.environ.get("POD_NAMESPACE")
        or (namespaces[0] if namespaces else None),
        lease_duration=a.leader_election_lease_duration,
        router_timeout=a.router_timeout,
        log_level=a.log_level,
        leader_election_renew_deadline=a.leader_election_renew_deadline,
        leader_election_retry_period=a.leader_election_retry_period,
        kube_request_timeout=a.kube_request_timeout,
        allowed_router_services=allowed_routers,
        allowed_endpoints=allowed_endpoints,
        inference_pools=a.inference_pools,
    )


# -- leadership -----------------------------------------------------------------------------------------
def _leadership_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--leader-election-renew-deadline",
        type=float,
        default=float(_env("leader-election-renew-deadline", "10")),
        help="seconds the leader may go without a successful renewal (default 10; < lease duration)",
    )
    p.add_argument(
        "--leader-election-retry-period",
        type=float,
        default=float(_env("leader-election-retry-period", "2")),
        help="seconds between renewals and between a standby's tries (default 2)",
    )
    p.add_argument(
        "--kube-request-timeout",
        type=float,
        default=float(_env("kube-request-timeout", "5")),
        help="seconds every Kubernetes API call of the operator's own may take (default 5)",
    )


def _check_leadership(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The timing invariant of leadership.py: renew deadline + the longest call timeout <= lease duration, so
    a call the old leader started before its deadline has ended before a standby can take the lease."""
    if a.kube_request_timeout <= 0:
        p.error("--kube-request-timeout must be positive")
    if not a.leader_election:
        return
    timing = LeaseTiming(
        lease_duration=a.leader_election_lease_duration,
        renew_deadline=a.leader_election_renew_deadline,
        retry_period=a.leader_election_retry_period,
    )
    problems = timing.problems(call_timeout=max(a.kube_request_timeout, a.router_timeout))
    if problems:
        p.error("leader election timings: " + "; ".join(problems))


# -- tenancy --------------------------------------------------------------------------------------------
def _tenancy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-router-service",
        action="append",
        default=None,
        metavar="NS/NAME",
        help="a router Service SMGWorkers may target (repeat; default: --router-service in --router-namespace or "
        "POD_NAMESPACE, nothing else); the admin token is sent only to pods behind these",
    )
    p.add_argument(
        "--allowed-endpoint",
        action="append",
        default=None,
        metavar="CIDR|HOST|*.SUFFIX",
        help="what static spec.endpoints may name (repeat; default: " + " ".join(DEFAULT_ENDPOINT_RULES) + "); "
        "loopback, link-local, unspecified and multicast addresses only through a network inside their range",
    )


def _tenancy(
    p: argparse.ArgumentParser, a: argparse.Namespace, *, router_namespace: str | None
) -> tuple[frozenset[ServiceRef], EndpointAllowList]:
    """The allow-lists, from the flags, else from ``SMG_OPERATOR_ALLOWED_*`` (comma separated), else the defaults."""
    services = a.allowed_router_service or _split(_env("allowed-router-service", ""))
    rules = a.allowed_endpoint or _split(_env("allowed-endpoint", "")) or list(DEFAULT_ENDPOINT_RULES)
    try:
        allowed = (
            frozenset(parse_service_ref(s) for s in services)
            if services
            else default_router_services(router_service=a.router_service, router_namespace=router_namespace)
        )
        endpoints = EndpointAllowList.parse(rules)
    except RuleError as e:
        p.error(str(e))
    if not allowed:
        logging.getLogger(__name__).warning(
            "no router Service is allowed: every SMGWorker will be refused (RouterNotAllowed); set "
            "--allowed-router-service NS/NAME, or --router-service with --router-namespace (or POD_NAMESPACE)"
        )
    return allowed, endpoints


def _split(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]
