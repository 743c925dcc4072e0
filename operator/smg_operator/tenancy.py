"""Pure: which router Services an SMGWorker may target and which static endpoints it may register.

The operator holds the routers' admin token and writes to routers every team shares, so an SMGWorker's author
must not choose where those writes go (a Service of their own would receive the token: a confused deputy) nor
point a shared router at an address only the cluster can reach (loopback, link-local such as the cloud metadata
service 169.254.169.254).  ``reconciler`` asks this module before it makes any call; nothing here does I/O.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from smg_operator.desired import PodInfo, Replica, http_url

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
ServiceRef = tuple[str, str]
"""(namespace, name) of a router Service."""

GUARDED: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",  # loopback
        "::1/128",
        "169.254.0.0/16",  # link-local, the cloud metadata service among them
        "fe80::/10",
        "0.0.0.0/8",  # "this network": 0.0.0.0 reaches the local host on Linux
        "::/128",  # unspecified
        "224.0.0.0/4",  # multicast
        "ff00::/8",
        "255.255.255.255/32",  # broadcast
    )
)
"""Ranges an endpoint may be in only when an allow-list rule names a network inside the range itself: a broad
rule such as ``0.0.0.0/0`` never opens them."""

DEFAULT_ENDPOINT_RULES = ("0.0.0.0/0", "::/0", "*.svc", "*.svc.cluster.local")
"""IP literals outside ``GUARDED``, and in-cluster Service names (whose Endpoints the API server refuses to
point at loopback or link-local addresses); any other host name is refused, as it could resolve anywhere."""


class RuleError(ValueError):
    """An allow-list entry that is neither NS/NAME (routers) nor a CIDR, an IP, a host or ``*.suffix``."""


def parse_service_ref(text: str) -> ServiceRef:
    """``NS/NAME`` → (namespace, name)."""
    namespace, sep, name = text.strip().partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise RuleError(f"{text!r}: a router Service is NAMESPACE/NAME")
    return namespace, name


def default_router_services(*, router_service: str | None, router_namespace: str | None) -> frozenset[ServiceRef]:
    """The operator's own default router only; nothing when its namespace is unknown.

    Never "a Service of that name in any namespace": a tenant can create one in their own namespace."""
    if not router_service or not router_namespace:
        return frozenset()
    return frozenset({(router_namespace, router_service)})


def router_refusal(target: ServiceRef, allowed: Iterable[ServiceRef]) -> str | None:
    """Why the operator will not call the pods behind ``target`` (None: it may)."""
    allowed = frozenset(allowed)
    if target in allowed:
        return None
    names = ", ".join(f"{ns}/{name}" for ns, name in sorted(allowed)) or "none"
    return (
        f"Service {target[0]}/{target[1]} is not an allowed router (smg-operator --allowed-router-service; "
        f"allowed: {names}); no call was made to it"
    )


def trusted_replicas(
    recorded: Iterable[Replica],
    *,
    pods: Iterable[PodInfo],
    allowed: Iterable[ServiceRef],
) -> list[Replica]:
    """Of the replicas an earlier pass recorded in ``status`` (which whoever may write the SMGWorker's status can
    forge), those whose pod runs now in the namespace of an allowed router Service, at that pod's own address.

    Nothing else gets the admin token: a forged ``{"pod": <a tenant's pod>, "url": "http://attacker"}`` is
    dropped, and a recorded URL's host is replaced by the pod's IP (its port is kept).  Not "selected by an
    allowed Service now": the replicas worth cleaning are exactly the ones their Service no longer selects (it
    changed or was deleted), and the router namespaces are the administrator's, not a tenant's."""
    pods = list(pods)
    namespaces = {ns for ns, _ in allowed}
    out: list[Replica] = []
    for r in recorded:
        try:
            port = urlsplit(r.url).port
        except ValueError:
            port = None
        pod = next(
            (p for p in pods if (p.namespace, p.name) == (r.namespace, r.pod) and p.running and not p.terminating),
            None,
        )
        if port is None or pod is None or not pod.ip or pod.namespace not in namespaces:
            continue
        out.append(Replica(pod=r.pod, url=http_url(pod.ip, port), namespace=r.namespace))
    return out


@dataclass(frozen=True, slots=True)
class EndpointAllowList:
    """The hosts static ``spec.endpoints`` may name: networks, exact host names and ``*.suffix`` patterns."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    """Each with its leading dot: ``*.svc`` is ``.svc``."""

    @classmethod
    def parse(cls, rules: Iterable[str]) -> EndpointAllowList:
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        suffixes: list[str] = []
        for raw in rules:
            rule = raw.strip().lower().rstrip(".")
            if not rule:
                continue
            if rule.startswith("*."):
                if not _hostname(rule[2:]):
                    raise RuleError(f"{raw!r}: *.suffix needs a host-name suffix")
                suffixes.append(rule[1:])
                continue
            try:
                networks.append(ipaddress.ip_network(rule, strict=False))
                continue
            except ValueError:
                pass
            if not _hostname(rule):
                raise RuleError(f"{raw!r}: not a CIDR, an IP address, a host name or *.suffix")
            hosts.add(rule)
        return cls(networks=tuple(networks), hosts=frozenset(hosts), suffixes=tuple(suffixes))

    def refusal(self, url: str) -> str | None:
        """Why ``url`` may not be registered (None: it may)."""
        try:
            host = (urlsplit(url).hostname or "").rstrip(".")
        except ValueError:
            host = ""
        if not host:
            return f"{url}: no host"
        address = _address(host)
        if address is not None:
            return None if self._allows_address(address) else f"{url}: {_describe(address)}"
        if not _hostname(host):
            return f"{url}: {host!r} is not an IP address or a host name"
        if host in self.hosts or any(host.endswith(s) and len(host) > len(s) for s in self.suffixes):
            return None
        return f"{url}: host {host} matches no --allowed-endpoint rule"

    def _allows_address(self, address: IPAddress) -> bool:
        guard = next((g for g in GUARDED if g.version == address.version and address in g), None)
        return any(
            n.version == address.version and address in n and (guard is None or n.subnet_of(guard))  # type: ignore[arg-type]
            for n in self.networks
        )


def refused_endpoints(urls: Iterable[str], allowed: EndpointAllowList) -> list[str]:
    """One reason per static endpoint the allow-list refuses (empty: every one is allowed)."""
    return [why for why in (allowed.refusal(str(u)) for u in urls) if why is not None]


def _address(host: str) -> IPAddress | None:
    """``host`` as an IP address, also in the forms a resolver accepts (``127.1``, ``2130706433``, ``0x7f.1``) and
    IPv4-mapped IPv6 (``::ffff:169.254.169.254``), so none of them slips past as a "host name"."""
    try:
        address: IPAddress = ipaddress.ip_address(host)
    except ValueError:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _hostname(host: str) -> bool:
    labels = host.split(".")
    return bool(host) and len(host) <= 253 and all(_label(label) for label in labels)


def _label(label: str) -> bool:
    ok = all(c.isascii() and (c.isalnum() or c == "-") for c in label)
    return ok and 0 < len(label) <= 63 and not label.startswith("-") and not label.endswith("-")


def _describe(address: IPAddress) -> str:
    for kind, test in (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified or address in ipaddress.ip_network("0.0.0.0/8")),
        ("broadcast", address == ipaddress.IPv4Address("255.255.255.255")),
    ):
        if test:
            return f"{address} is {kind} (allowed only by an --allowed-endpoint network inside that range)"
    return f"{address} is in no --allowed-endpoint network"


DEFAULT_ENDPOINTS = EndpointAllowList.parse(DEFAULT_ENDPOINT_RULES)
"""The allow-list of ``DEFAULT_ENDPOINT_RULES`` (what ``--allowed-endpoint`` means when it is not given)."""
