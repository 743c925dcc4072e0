"""Non-generation routes of a worker: health, model/server info, load reports and cache control.

These are what a router polls (health checks, /v1/loads, /metrics) and what discovery reads
(/get_model_info, /get_server_info, with SGLang's field names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from .errors import ApiError, json_response
from .metrics import loads_report, prometheus_text
from .state import STATE_KEY
from .version import __version__

if TYPE_CHECKING:
    from .kv_events import KvEventPublisher

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def health(request: web.Request) -> web.Response:
    """GET /health and /health_generate: 503 while warming up (`--slow-start`)."""
    state = request.app[STATE_KEY]
    if state.warming_up():
        raise ApiError(503, "server is warming up (--slow-start)", type="server_error", code="warming_up")
    return web.Response(text="")


async def model_info(request: web.Request) -> web.Response:
    model = request.app[STATE_KEY].config.model
    return json_response({"model_path": model, "tokenizer_path": model, "is_generation": True})


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    cfg = state.config
    stats = state.engine.stats()
    return json_response(
        {
            "model_path": cfg.model,
            "tokenizer_path": cfg.model,
            "served_model_name": cfg.model,
            "host": cfg.host,
            "port": int(state.worker_id.rsplit(":", 1)[-1]) if state.worker_id else cfg.port,
            "role": cfg.role,
            "disaggregation_mode": cfg.disaggregation_mode,
            "disaggregation_bootstrap_port": state.bootstrap_port,
            "max_running_requests": cfg.max_running,
            "max_total_num_tokens": cfg.kv_capacity,
            "version": __version__,
            "engine": "smg-sim",
            "sim_config": cfg.as_dict(),
            "kv_events": _kv_events(state.engine.kv_events, block_size=cfg.block_size),
            "internal_states": [{"cache_tokens": stats.cached_tokens_in_tree, "requests_total": stats.requests_total}],
        }
    )


def _kv_events(publisher: KvEventPublisher | None, *, block_size: int) -> dict[str, Any] | None:
    """Where the KV events are (the bound addresses), as SGLang's /server_info tells its router."""
    if publisher is None:
        return None
    return {
        "publisher": "zmq",
        "endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
        "topic": publisher.topic,
        "format": publisher.fmt,
        "block_size": block_size,
    }


async def loads(request: web.Request) -> web.Response:
    """GET /v1/loads (the `include=` query parameter is accepted and ignored)."""
    return json_response(loads_report(request.app[STATE_KEY].engine.stats()))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    text = prometheus_text(
        state.engine.stats(), model=state.config.model, generation_requests=state.faults.requests_seen
    )
    return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


async def flush_cache(request: web.Request) -> web.Response:
    """POST /flush_cache: empty the prefix cache (as SGLang's endpoint does)."""
    request.app[STATE_KEY].engine.cache.clear()
    return web.Response(text="Cache flushed.\n")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """POST /reset_prefix_cache: vLLM's name for the same (an empty 200 answer, as vLLM's)."""
    request.app[STATE_KEY].engine.cache.clear()
    return web.Response()
