"""The floor under the Endpoint Picker's cost: Envoy asking an ext_proc server that does nothing, on grpc.aio.

Usage (from the repository root, with the project's venv):
    .venv/bin/python bench/epp_floor.py [--body-mode FULL_DUPLEX_STREAMED] [--duration 3] [--streams 0,1]

The server answers every message "continue" (a full-duplex body chunk is sent back as it came), on uvloop as the
router runs, with grpcio's defaults: what one ext_proc stream per request costs in grpcio before any picking.  The
rest is ``bench/bench_epp.py``'s method and config (two smg-sim workers, Envoy with one worker thread and the test
gateway's ext_proc config, ~1 KB chat requests from ``wrk`` at 8 connections, everything but wrk on one core); no
destination is set, so Envoy sends each request to the pool's workers by round robin.  Prints req/s, p50, and the
CPU per request of the server and of Envoy.  ``--serve PORT`` runs the server alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "routing"), str(HERE.parent / "tests")]

from bench_proxy import LOAD_CORE, SUT_CORE, Cell, start_sims, tree_cpu, wrk  # noqa: E402
from fleet import stop_all  # noqa: E402
from support.envoy import start_envoy  # noqa: E402
from support.procs import Proc, free_port, wait_until  # noqa: E402


async def serve(port: int) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    answers = {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
        "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
        "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    }
    full_duplex = 4  # ProcessingMode.FULL_DUPLEX_STREAMED

    class Empty(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(
            self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
        ) -> None:
            echo = False
            while (msg := await context.read()) is not grpc.aio.EOF:
                if msg.HasField("protocol_config"):
                    echo = msg.protocol_config.request_body_mode == full_duplex
                kind = msg.WhichOneof("request")
                if kind == "request_body" and echo:
                    body = pb.StreamedBodyResponse(
                        body=msg.request_body.body, end_of_stream=msg.request_body.end_of_stream
                    )
                    mutation = pb.BodyMutation(streamed_response=body)
                    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
                    await context.write(pb.ProcessingResponse(request_body=answer))
                else:
                    await context.write(answers[kind])

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Empty(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--body-mode", default="FULL_DUPLEX_STREAMED", choices=("BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED")
    )
    p.add_argument("--duration", type=int, default=3, help="seconds measured per cell (after 1 s of warmup)")
    p.add_argument("--streams", default="0,1", help="0: whole answers, 1: SSE streams")
    p.add_argument("--serve", type=int, default=0, help="run the empty server alone on this port")
    args = p.parse_args(argv)
    if args.serve:
        import uvloop

        uvloop.run(serve(args.serve))
        return 0
    logs = Path(tempfile.mkdtemp(prefix="bench-epp-floor-"))
    procs: list[Proc] = []
    try:
        os.sched_setaffinity(0, {SUT_CORE})
        sims = start_sims(logs, 2)
        procs += sims
        port = free_port("127.0.0.1")
        server = Proc(
            name="empty-ext-proc", args=[sys.executable, __file__, "--serve", str(port)], log_path=logs / "empty.log"
        )
        procs.append(server.start())
        wait_until(lambda: "ready" in server.log() or not server.alive(), timeout=20, what="the empty server")
        if not server.alive():
            raise RuntimeError(f"the empty server exited:\n{server.log()}")
        gateway = start_envoy(
            logs,
            epp=("127.0.0.1", port),
            pool=[(s.host, s.port) for s in sims],
            request_body_mode=args.body_mode,
            route_timeout="30s",
        )
        procs.append(gateway)
        os.sched_setaffinity(0, {LOAD_CORE})
        for stream in args.streams.split(","):
            cell = Cell("chat", stream == "1", 8)
            wrk(gateway.url, cell, 1, "warm" + uuid.uuid4().hex[:8])
            s0, e0 = tree_cpu([server]), tree_cpu([gateway])
            s = wrk(gateway.url, cell, args.duration, uuid.uuid4().hex[:8])
            s1, e1 = tree_cpu([server]), tree_cpu([gateway])
            n = max(1, s["requests"])
            print(
                f"{args.body_mode} c=8 {cell.label:12} {s['requests'] / (s['duration_us'] / 1e6):5.0f} req/s  "
                f"p50 {s['latency_us']['p50'] / 1e3:5.2f} ms  empty server {(s1 - s0) / n * 1e6:4.0f} µs/req  "
                f"envoy {(e1 - e0) / n * 1e6:4.0f} µs/req  errors {sum(s['errors'].values())}"
            )
    finally:
        stop_all(procs[2:], kill=True)
        stop_all(procs[:2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
