"""Pure tenancy policy: which router Services an SMGWorker may target, which static endpoints it may register,
and the flags that set both."""

from __future__ import annotations

import pytest
from smg_operator.desired import PodInfo, Replica
from smg_operator.settings import parse_settings
from smg_operator.tenancy import (
    DEFAULT_ENDPOINTS,
    EndpointAllowList,
    RuleError,
    default_router_services,
    parse_service_ref,
    refused_endpoints,
    router_refusal,
    trusted_replicas,
)


# -- router Services -----------------------------------------------------------------------------------
def test_the_default_router_allow_list_is_the_operators_own_router_in_its_own_namespace_only() -> None:
    assert default_router_services(router_service="smg-router", router_namespace="smg-system") == {
        ("smg-system", "smg-router")
    }
    # no namespace known: nothing, never "a Service of that name in any namespace"
    assert default_router_services(router_service="smg-router", router_namespace=None) == frozenset()
    assert default_router_services(router_service=None, router_namespace="smg-system") == frozenset()


def test_a_router_service_of_the_same_name_in_another_namespace_is_refused() -> None:
    allowed = {("smg-system", "smg-router")}
    assert router_refusal(("smg-system", "smg-router"), allowed) is None
    why = router_refusal(("team-a", "smg-router"), allowed)
    assert why is not None and "team-a/smg-router" in why and "smg-system/smg-router" in why
    assert router_refusal(("smg-system", "other"), allowed) is not None
    assert "allowed: none" in (router_refusal(("a", "b"), set()) or "")


@pytest.mark.parametrize("text", ["smg-router", "/smg-router", "ns/", "a/b/c", ""])
def test_a_router_service_must_be_namespace_slash_name(text: str) -> None:
    with pytest.raises(RuleError):
        parse_service_ref(text)


def _pod(ns: str, name: str, ip: str, labels: dict[str, str], *, running: bool = True) -> PodInfo:
    return PodInfo(
        namespace=ns,
        name=name,
        uid=f"uid-{name}",
        labels=labels,
        annotations={},
        ip=ip,
        running=running,
        ready=True,
        terminating=False,
    )


def test_recorded_replicas_are_trusted_only_as_running_pods_of_a_router_namespace_at_their_own_address() -> None:
    pods = [
        _pod("smg-system", "router-0", "10.0.0.7", {"app": "smg-router"}),
        _pod("smg-system", "old-router", "10.0.0.6", {"app": "was-a-router"}),  # no Service selects it any more
        _pod("team-a", "any-pod", "10.1.0.9", {"app": "w"}),
        _pod("smg-system", "gone", "10.0.0.8", {"app": "smg-router"}, running=False),
    ]
    recorded = [
        Replica(pod="router-0", namespace="smg-system", url="http://attacker.example:30000"),  # host forged
        Replica(pod="old-router", namespace="smg-system", url="http://10.0.0.6:30000"),  # a former replica
        Replica(pod="any-pod", namespace="team-a", url="http://10.1.0.9:30000"),  # not a router namespace
        Replica(pod="gone", namespace="smg-system", url="http://10.0.0.8:30000"),  # pod no longer runs
        Replica(pod="ghost", namespace="smg-system", url="http://10.0.0.9:30000"),  # no such pod
        Replica(pod="router-0", namespace="smg-system", url="no-port"),
    ]
    trusted = trusted_replicas(recorded, pods=pods, allowed={("smg-system", "smg-router")})
    assert trusted == [
        Replica(pod="router-0", namespace="smg-system", url="http://10.0.0.7:30000"),
        Replica(pod="old-router", namespace="smg-system", url="http://10.0.0.6:30000"),
    ]
    assert trusted_replicas(recorded, pods=pods, allowed=set()) == []


# -- static endpoints ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.5:8000",
        "https://203.0.113.7",
        "http://[fd00::5]:8000",
        "http://[2001:db8::1]:80/",
        "http://llama.team-a.svc:8000",
        "http://llama.team-a.svc.cluster.local:8000",
        "http://llama.team-a.svc.cluster.local.:8000",
    ],
)
def test_the_default_allows_ordinary_ip_literals_and_in_cluster_service_names(url: str) -> None:
    assert DEFAULT_ENDPOINTS.refusal(url) is None


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://169.254.169.254:80", "link-local"),
        ("http://169.254.169.254", "link-local"),
        ("http://user@169.254.169.254/", "link-local"),  # userinfo does not hide the host
        ("http://2852039166/", "link-local"),  # 169.254.169.254 as one number, as resolvers accept it
        ("http://[::ffff:169.254.169.254]/", "link-local"),  # IPv4-mapped IPv6
        ("http://127.0.0.1:8000", "loopback"),
        ("http://127.1:8000", "loopback"),
        ("http://0x7f.0.0.1:8000", "loopback"),
        ("http://[::1]:8000", "loopback"),
        ("http://[fe80::1]:8000", "link-local"),
        ("http://0.0.0.0:8000", "unspecified"),
        ("http://[::]:8000", "unspecified"),
        ("http://224.0.0.1", "multicast"),
        ("http://[ff02::1]", "multicast"),
    ],
)
def test_the_default_refuses_loopback_link_local_unspecified_and_multicast(url: str, kind: str) -> None:
    why = DEFAULT_ENDPOINTS.refusal(url)
    assert why is not None and why.startswith(url) and kind in why


@pytest.mark.parametrize("url", ["http://evil.example.com", "http://localhost:8000", "http://svc:80", "http:///x"])
def test_the_default_refuses_host_names_outside_the_cluster(url: str) -> None:
    assert DEFAULT_ENDPOINTS.refusal(url) is not None


def test_a_guarded_range_opens_only_to_a_network_inside_it() -> None:
    loopback = EndpointAllowList.parse(["127.0.0.0/8"])
    assert loopback.refusal("http://127.0.0.5:8000") is None
    assert loopback.refusal("http://169.254.169.254") is not None  # loopback listed: link-local still refused
    assert loopback.refusal("http://10.0.0.1") is not None  # the list replaces the default
    everything = EndpointAllowList.parse(["0.0.0.0/0", "::/0", "0.0.0.0/1"])
    for url in ("http://127.0.0.1", "http://169.254.169.254", "http://[::1]", "http://[fe80::1]"):
        assert everything.refusal(url) is not None, url
    metadata = EndpointAllowList.parse(["169.254.169.254"])
    assert metadata.refusal("http://169.254.169.254:80") is None
    assert metadata.refusal("http://169.254.169.253:80") is not None


def test_host_rules_are_exact_or_suffixes_and_case_insensitive() -> None:
    rules = EndpointAllowList.parse(["Workers.Example.COM", "*.gpu.example.net"])
    assert rules.refusal("http://workers.example.com:80") is None
    assert rules.refusal("http://a.workers.example.com:80") is not None
    assert rules.refusal("http://n1.gpu.example.net:80") is None
    assert rules.refusal("http://gpu.example.net:80") is not None  # *.suffix needs a label before it
    assert rules.refusal("http://evilgpu.example.net:80") is not None
    assert rules.refusal("http://10.0.0.1:80") is not None  # no network listed


@pytest.mark.parametrize("rule", ["not a host", "10.0.0.0/33", "*.", "http://x", "a..b"])
def test_a_malformed_endpoint_rule_is_an_error(rule: str) -> None:
    with pytest.raises(RuleError):
        EndpointAllowList.parse([rule])


def test_refused_endpoints_names_each_refused_url() -> None:
    refused = refused_endpoints(
        ["http://10.0.0.1:80", "http://169.254.169.254:80", "http://[::1]:80"], DEFAULT_ENDPOINTS
    )
    assert len(refused) == 2
    assert refused[0].startswith("http://169.254.169.254:80") and refused[1].startswith("http://[::1]:80")


# -- flags ---------------------------------------------------------------------------------------------
def test_flags_default_to_the_operators_own_router_and_the_default_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    s = parse_settings(["--router-service", "smg-router", "--router-namespace", "smg-system"])
    assert s.allowed_router_services == {("smg-system", "smg-router")}
    assert s.allowed_endpoints == DEFAULT_ENDPOINTS
    assert parse_settings(["--router-service", "smg-router"]).allowed_router_services == frozenset()
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    s = parse_settings(["--router-service", "smg-router"])
    assert s.allowed_router_services == {("ops", "smg-router")} and s.router_namespace == "ops"


def test_flags_and_their_environment_variables_replace_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    s = parse_settings(
        [
            "--router-service=smg-router",
            "--router-namespace=smg-system",
            "--allowed-router-service=a/r1",
            "--allowed-router-service=b/r2",
            "--allowed-endpoint=127.0.0.0/8",
        ]
    )
    assert s.allowed_router_services == {("a", "r1"), ("b", "r2")}
    assert s.allowed_endpoints.refusal("http://127.0.0.3:1") is None
    assert s.allowed_endpoints.refusal("http://10.0.0.1:1") is not None
    monkeypatch.setenv("SMG_OPERATOR_ALLOWED_ROUTER_SERVICE", "x/y, z/w")
    monkeypatch.setenv("SMG_OPERATOR_ALLOWED_ENDPOINT", "10.0.0.0/8,*.svc")
    s = parse_settings([])
    assert s.allowed_router_services == {("x", "y"), ("z", "w")}
    assert s.allowed_endpoints.refusal("http://10.1.2.3:1") is None
    assert s.allowed_endpoints.refusal("http://a.b.svc:1") is None
    assert s.allowed_endpoints.refusal("http://11.0.0.1:1") is not None


@pytest.mark.parametrize("argv", [["--allowed-router-service", "no-slash"], ["--allowed-endpoint", "10.0.0.0/40"]])
def test_a_malformed_allow_list_flag_stops_the_operator(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(argv)
