"""The `smg-sim` command (also `python -m smg_sim`): parse flags into a SimConfig and serve until a signal.

Uses uvloop when installed, like a production engine front end would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Sequence

from .config import CACHE_ON, DEFAULT_BOOTSTRAP_PORT, KV_EVENTS_FORMATS, ROLES, VLLM_PD_ROLES, SimConfig
from .server import start_sim

log = logging.getLogger("smg_sim")


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="smg-sim",
        description="Simulated SGLang/OpenAI-compatible LLM inference worker (no GPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on (0 = any free port)")
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--role", choices=ROLES, default=d.role, help="PD disaggregation role (SGLang bootstrap)")
    p.add_argument(
        "--vllm-pd",
        choices=VLLM_PD_ROLES,
        default=d.vllm_pd,
        help="vLLM PD role (kv_transfer_params; --bootstrap-port is then the prefill's KV side channel, default 5600)",
    )
    p.add_argument(
        "--bootstrap-port",
        type=int,
        default=None,
        help=f"prefill role: bootstrap server port (default {DEFAULT_BOOTSTRAP_PORT})",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="multiplier on all simulated durations (0.01 = 100x faster)",
    )
    p.add_argument("--max-running", type=int, default=d.max_running, help="max concurrently running requests")
    p.add_argument("--kv-capacity", type=int, default=d.kv_capacity, help="KV cache capacity in tokens")
    p.add_argument("--prefill-tps", type=float, default=d.prefill_tps, help="prefill speed, uncached tokens/s")
    p.add_argument("--decode-step-ms", type=float, default=d.decode_step_ms, help="base decode step time")
    p.add_argument(
        "--decode-step-ms-per-req",
        type=float,
        default=d.decode_step_ms_per_req,
        help="extra decode step time per running request",
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=d.max_tokens_default,
        help="completion length when the request does not set one",
    )
    p.add_argument(
        "--error-rate", type=float, default=d.error_rate, help="fraction of requests answered --error-status"
    )
    p.add_argument(
        "--error-status", type=int, default=d.error_status, help="status of the --error-rate answers (e.g. 429, 503)"
    )
    p.add_argument("--hang-rate", type=float, default=d.hang_rate, help="fraction of requests never answered")
    p.add_argument("--slow-start", type=float, default=d.slow_start, help="seconds of 503 from /health at start")
    p.add_argument("--crash-after", type=int, default=None, help="exit(1) on the N-th generation request")
    p.add_argument("--seed", type=int, default=None, help="seed of the fault injection")
    p.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=d.bootstrap_timeout,
        help="seconds to wait for a bootstrap room (both sides of PD)",
    )
    p.add_argument(
        "--room-ttl",
        type=float,
        default=d.room_ttl,
        help="seconds a finished prefill stays readable by a decode (vLLM PD: the abort timeout of held KV)",
    )
    p.add_argument(
        "--stream-head-first",
        action="store_true",
        help="decode role: send an OpenAI stream's head before the KV arrived from the prefill worker (as SGLang does)",
    )
    p.add_argument(
        "--cache-on",
        choices=CACHE_ON,
        default=d.cache_on,
        help="when a prompt enters the prefix cache: after its prefill (SGLang) or when scheduled (vLLM)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (the KV events' unit)")
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV events on this ZeroMQ PUB address, e.g. tcp://127.0.0.1:5557 (default: off)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="answer replay requests (start seq) on this ZeroMQ ROUTER address, e.g. tcp://127.0.0.1:5558",
    )
    p.add_argument("--kv-events-topic", default=d.kv_events_topic, help="topic frame of the KV event messages")
    p.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        default=d.kv_events_buffer_steps,
        help="batches the replay socket keeps (vLLM's buffer_steps)",
    )
    p.add_argument(
        "--kv-events-format",
        choices=KV_EVENTS_FORMATS,
        default=d.kv_events_format,
        help="wire format: vllm/sglang (events as tagged maps) or vllm-array/sglang-array (older positional)",
    )
    p.add_argument(
        "--log-level",
        default=d.log_level,
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
        help="logging level",
    )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        role=args.role,
        vllm_pd=args.vllm_pd,
        bootstrap_port=args.bootstrap_port,
        time_scale=args.time_scale,
        max_running=args.max_running,
        kv_capacity=args.kv_capacity,
        prefill_tps=args.prefill_tps,
        decode_step_ms=args.decode_step_ms,
        decode_step_ms_per_req=args.decode_step_ms_per_req,
        max_tokens_default=args.max_tokens_default,
        error_rate=args.error_rate,
        error_status=args.error_status,
        hang_rate=args.hang_rate,
        slow_start=args.slow_start,
        crash_after=args.crash_after,
        seed=args.seed,
        log_level=args.log_level,
        bootstrap_timeout=args.bootstrap_timeout,
        room_ttl=args.room_ttl,
        stream_head_first=args.stream_head_first,
        cache_on=args.cache_on,
        block_size=args.block_size,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_format=args.kv_events_format,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
    )


async def serve(config: SimConfig) -> None:
    """Run a worker until SIGINT/SIGTERM."""
    server = await start_sim(config, access_log=config.log_level.lower() == "debug")
    # start-up's objects (modules, functions, aiohttp's app: ~45 000) leave the collector's full walks, which
    # under a benchmark's load paused a worker for 30 ms of CPU every few seconds, all the routers measured alike
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    boot = f", bootstrap on {server.bootstrap_url}" if server.bootstrap_url else ""
    if config.vllm_pd == "prefill":
        boot = f", vLLM PD prefill, KV side channel on port {server.state.bootstrap_port}"
    elif config.vllm_pd == "decode":
        boot = ", vLLM PD decode"
    events = server.state.engine.kv_events
    if events is not None:
        replay = f", replay on {events.replay_endpoint}" if events.replay_endpoint else ""
        boot += f", KV events ({events.fmt}) on {events.endpoint}{replay}"
    log.info(
        "smg-sim serving model %r on %s (role=%s%s, time_scale=%g, max_running=%d, kv_capacity=%d)",
        config.model,
        server.url,
        config.role,
        boot,
        config.time_scale,
        config.max_running,
        config.kv_capacity,
    )
    try:
        await stop.wait()
    finally:
        log.info("smg-sim on %s shutting down", server.url)
        await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"smg-sim: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        run(serve(config))
    except OSError as exc:
        log.error("smg-sim failed to start on %s:%s: %s", config.host, config.port, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
