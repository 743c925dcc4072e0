"""Assembles a worker: the aiohttp app with all routes, its lifecycle, and the in-process API.

`create_app` wires the engine and route modules together; `start_sim` binds the sockets (the worker port
and, for a prefill worker, the bootstrap port) and returns a `SimServer` handle. The CLI (`__main__`) and
tests both go through `start_sim`, so an in-process worker behaves exactly like a subprocess one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from types import TracebackType

import aiohttp
from aiohttp import web
from aiohttp.log import access_logger

from . import anthropic_api, info_api, openai_api, pooling_api, responses_api, sglang_api
from .bootstrap import RoomTable, create_bootstrap_app
from .config import SimConfig
from .engine import Engine
from .errors import error_middleware
from .faults import FaultInjector
from .state import STATE_KEY, SimState, crash_process
from .vllm_pd import install as install_vllm_pd

log = logging.getLogger(__name__)

WORKER_HEADER = "x-smg-sim-worker"
#: How long shutdown waits for in-flight handlers (streams, hung requests) before cancelling them.
SHUTDOWN_TIMEOUT_S = 0.5
_MAX_BODY_BYTES = 64 * 1024 * 1024


def _worker_header(state: SimState) -> Callable[[web.BaseRequest, web.StreamResponse], Awaitable[None]]:
    """Tag every response with the worker's identity, so tests can tell who served a request."""

    async def add_header(request: web.BaseRequest, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = state.worker_id

    return add_header


async def _on_startup(app: web.Application) -> None:
    state = app[STATE_KEY]
    state.engine.start()
    state.session = aiohttp.ClientSession()


async def _on_cleanup(app: web.Application) -> None:
    state = app[STATE_KEY]
    await state.engine.stop()
    if state.session is not None:
        await state.session.close()


def create_app(config: SimConfig, *, crash: Callable[[], None] | None = None) -> web.Application:
    """The worker's aiohttp app; `crash` replaces the `--crash-after` exit (for in-process tests)."""
    state = SimState(
        config=config,
        engine=Engine(config),
        faults=FaultInjector.from_config(config),
        crash=crash or crash_process,
        rooms=RoomTable(ttl=config.room_ttl) if config.role == "prefill" else None,
    )
    app = web.Application(middlewares=[error_middleware], client_max_size=_MAX_BODY_BYTES)
    app[STATE_KEY] = state
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    app.on_response_prepare.append(_worker_header(state))
    add = app.router
    add.add_get("/health", info_api.health)
    add.add_get("/health_generate", info_api.health)
    add.add_get("/get_model_info", info_api.model_info)
    add.add_get("/get_server_info", info_api.server_info)
    add.add_get("/server_info", info_api.server_info)
    add.add_get("/v1/loads", info_api.loads)
    add.add_get("/metrics", info_api.metrics)
    add.add_post("/flush_cache", info_api.flush_cache)
    add.add_post("/reset_prefix_cache", info_api.reset_prefix_cache)
    add.add_get("/v1/models", openai_api.models)
    add.add_post("/v1/completions", openai_api.completions)
    add.add_post("/v1/chat/completions", openai_api.chat_completions)
    add.add_post("/generate", sglang_api.generate)
    install_vllm_pd(app)  # --vllm-pd: kv_transfer_params on the OpenAI endpoints, the prefill's side channel
    add.add_post("/v1/messages", anthropic_api.messages)
    add.add_post("/v1/responses", responses_api.responses)
    add.add_post("/v1/embeddings", pooling_api.embeddings)
    add.add_post("/v1/rerank", pooling_api.rerank)
    add.add_post("/rerank", pooling_api.rerank)
    add.add_post("/v1/score", pooling_api.score)
    add.add_post("/v1/classify", pooling_api.classify)
    add.add_post("/v1/tokenize", pooling_api.tokenize)
    add.add_post("/v1/detokenize", pooling_api.detokenize)
    add.add_post("/v1/chat/completions/render", pooling_api.chat_render)
    add.add_post("/v1/completions/render", pooling_api.completions_render)
    add.add_post("/v1/audio/transcriptions", pooling_api.transcriptions)
    return app


async def _serve(app: web.Application, host: str, port: int, *, access_log: bool) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        access_log=access_logger if access_log else None,  # aiohttp's own default logger, or none
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


class SimServer:
    """A running worker; `await stop()` (or `async with`) shuts it down."""

    def __init__(
        self,
        *,
        config: SimConfig,
        app: web.Application,
        runner: web.AppRunner,
        port: int,
        bootstrap_runner: web.AppRunner | None = None,
        bootstrap_port: int | None = None,
    ) -> None:
        self.config = config
        self.app = app
        self.host = config.host
        self.port = port
        self.bootstrap_port = bootstrap_port
        self._runner = runner
        self._bootstrap_runner = bootstrap_runner

    @property
    def url(self) -> str:
        return f"http://{_hostport(self.host, self.port)}"

    @property
    def bootstrap_url(self) -> str | None:
        return None if self.bootstrap_port is None else f"http://{_hostport(self.host, self.bootstrap_port)}"

    @property
    def state(self) -> SimState:
        return self.app[STATE_KEY]

    async def stop(self) -> None:
        if self._bootstrap_runner is not None:
            await self._bootstrap_runner.cleanup()
            self._bootstrap_runner = None
        await self._runner.cleanup()

    async def __aenter__(self) -> SimServer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_sim(
    config: SimConfig, *, crash: Callable[[], None] | None = None, access_log: bool = False
) -> SimServer:
    """Start a worker in the running event loop and return once it accepts connections."""
    app = create_app(config, crash=crash)
    runner, port = await _serve(app, config.host, config.port, access_log=access_log)
    state = app[STATE_KEY]
    state.worker_id = _hostport(config.host, port)
    bootstrap_runner = bootstrap_port = None
    wanted = config.effective_bootstrap_port
    if wanted is not None and state.rooms is not None:
        boot_app = create_bootstrap_app(state.rooms, wait_ceiling=config.bootstrap_timeout)
        boot_app.on_response_prepare.append(_worker_header(state))
        try:
            bootstrap_runner, bootstrap_port = await _serve(boot_app, config.host, wanted, access_log=access_log)
        except BaseException:
            await runner.cleanup()
            raise
        state.bootstrap_port = bootstrap_port
    return SimServer(
        config=config,
        app=app,
        runner=runner,
        port=port,
        bootstrap_runner=bootstrap_runner,
        bootstrap_port=bootstrap_port,
    )
