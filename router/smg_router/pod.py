"""``--processes N``: N serving processes on the one data port, and their parent (docs/architecture.md, "Processes").

The parent serves no request itself.  It starts the children (``python -m smg_router`` with the same command line
and ``--process-index``), each of which listens on the data port with SO_REUSEPORT (the kernel spreads new
connections over them) and on a private socket of its own (``app.child_socket``).  The parent then serves:

- the lifecycle API on ``--admin-port`` (and on its own socket, ``app.POD_SOCKET``, where a child hands what its data
  port received of it): a change (``admin.MUTATIONS``) goes to every child, at once, one at a time per worker; the
  answer is theirs when they all answer alike (every one applied it, or every one refused it: nothing changed), else
  a 502 ``processes_disagree`` naming each process's answer.  A read goes to child 0, so reads agree with each other.
- ``/metrics`` (on its socket: a child's data port hands it over): every child's exposition, merged
  (``metrics.merge_expositions``).

It supervises them: SIGTERM (or SIGINT) is passed to every child, which drains as a lone router does, and the parent
exits 0 when they all did.  A child that exits by itself is logged, the others are drained the same way, and the
parent exits 1: the container restarts, its workers are registered again (the operator does, as for any router
restarted), rather than a new child serving beside its siblings with an empty fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from urllib.parse import quote

import aiohttp
import orjson

from smg_router import admin, app, wire
from smg_router.app import POD_SOCKET, child_socket
from smg_router.coordination import auth, messages
from smg_router.errors import NotFound, RouterError, error_response
from smg_router.http_io import read_body
from smg_router.metrics import CONTENT_TYPE, merge_expositions
from smg_router.server import Server
from smg_router.settings import Settings
from smg_router.workers.worker import SpecError, normalize_url, worker_id_for

log = logging.getLogger("smg_router.pod")
START_SECONDS = 120.0
"""How long the children get to answer on their sockets after their start."""
STOP_GRACE = 5.0
"""Seconds past --shutdown-delay + --shutdown-timeout a child gets to exit on SIGTERM before it is killed."""
ANSWER_HEADERS = ("Content-Type", "Allow")


class Children:
    """The parent's way to its children: one HTTP client per private socket."""

    def __init__(self, directory: str, count: int) -> None:
        self.paths = [os.path.join(directory, child_socket(i)) for i in range(count)]
        self._sessions: list[aiohttp.ClientSession] = []

    def _session(self, index: int) -> aiohttp.ClientSession:
        if not self._sessions:
            self._sessions = [
                aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=path),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                )
                for path in self.paths
            ]
        return self._sessions[index]

    async def call(
        self, index: int, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        """One request to child ``index``: its status, body and the headers the pod passes on."""
        async with self._session(index).request(method, "http://child" + target, data=body, headers=headers) as answer:
            raw = await answer.read()
            return answer.status, raw, {k: v for k in ANSWER_HEADERS if (v := answer.headers.get(k)) is not None}

    async def close(self) -> None:
        for session in self._sessions:
            await session.close()


def _target(request: wire.Request) -> str:
    return quote(request.path) + (f"?{request.query_string}" if request.query_string else "")


def _describe(answer: tuple[int, bytes, dict[str, str]] | BaseException) -> str:
    if isinstance(answer, BaseException):
        return f"no answer ({answer.__class__.__name__}: {answer})"
    status, raw, _ = answer
    try:
        message = orjson.loads(raw)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return str(status)
    return f"{status} {message}"


class Pod:
    """The parent's HTTP handler: the lifecycle API for every child, and the pod's ``/metrics``."""

    def __init__(self, settings: Settings, children: Children) -> None:
        self._settings = settings
        self._children = children
        self._locks: dict[str, asyncio.Lock] = {}
        self.stopping = False
        self._kinds: dict[str, dict[str, bool]] = {}
        """Lifecycle path (``/workers/`` for the templated one) → method → whether it is a change."""
        for method, path, handler in admin.ROUTES:
            key = path.partition("{")[0]
            self._kinds.setdefault(key, {})[method] = handler in admin.MUTATIONS

    def _kind(self, path: str, method: str) -> str | None:
        methods = self._kinds.get(path)
        if methods is None and path.startswith("/workers/") and "/" not in path[len("/workers/") :]:
            methods = self._kinds.get("/workers/")
        if methods is None and path.startswith("/models/") and len(path) > len("/models/"):  # a name may hold "/"
            methods = self._kinds.get("/models/")
        if methods is None:
            return "metrics" if path == "/metrics" else None
        return "change" if methods.get(method) else "read"  # another method: child 0 answers the 405

    async def __call__(self, request: wire.Request) -> wire.Response:
        try:
            return await self._handle(request)
        except RouterError as e:
            return e.response()
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, "internal error in the router's parent process (logged)", type="server_error")

    async def _handle(self, request: wire.Request) -> wire.Response:
        s = self._settings.server
        kind = self._kind(request.path, request.method)
        on_admin_port = request.local_port is not None  # else the parent's socket: a child handing over its call
        if kind is None or (kind == "metrics" and on_admin_port):
            if on_admin_port:
                raise NotFound(
                    f"port {s.admin_port} serves only the worker lifecycle API; {request.path} is on port {s.port}",
                    code="not_on_admin_port",
                )
            raise NotFound(f"Unknown endpoint: {request.method} {request.path}", code="unknown_endpoint")
        if "Expect" in request.headers and request.version >= (1, 1):
            if request.headers["Expect"].lower() != "100-continue":
                raise RouterError(f"Unknown Expect: {request.headers['Expect']}", code="expectation_failed", status=417)
            request.send_continue()
        if kind == "metrics":
            return await self._metrics()
        body = await read_body(request, messages.BODY_LIMIT) if request.method not in ("GET", "HEAD") else b""
        headers = {k: v for k in (*app.FORWARDED, auth.SOURCE) if (v := request.headers.get(k)) is not None}
        if on_admin_port:  # from the network: where it came from is the connection's, whatever a header says
            headers.pop(auth.SOURCE, None)
            if request.remote is not None:
                headers[auth.SOURCE] = request.remote
        if kind == "read":
            try:
                status, raw, kept = await self._children.call(0, request.method, _target(request), body, headers)
            except aiohttp.ClientError as e:
                raise RouterError(f"process 0 did not answer: {e}", code="process_unavailable", status=503) from None
            return wire.Response(status=status, body=raw, headers=kept)
        key = self._lock_key(request, body)
        if key is None:
            return await self._everywhere(request, body, headers)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # one change at a time per worker: every process applies them in the same order
            return await self._everywhere(request, body, headers)

    def _lock_key(self, request: wire.Request, body: bytes) -> str | None:
        """The worker a change is about (its id), or the model, when it names one."""
        path = request.path
        if path.startswith("/workers/"):
            return path[len("/workers/") :]
        if path.startswith("/models/"):
            return path  # one declaration change at a time per model
        url: object = None
        if path == "/workers":
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                url = orjson.loads(body).get("url")
        elif path in ("/add_worker", "/remove_worker"):
            url = request.query.get("url")
        try:
            return worker_id_for(normalize_url(url)) if isinstance(url, str) else None
        except SpecError:
            return None

    async def _everywhere(self, request: wire.Request, body: bytes, headers: dict[str, str]) -> wire.Response:
        """A change applied by every child at once; their answer when they all answer alike."""
        target = _target(request)
        calls = [
            self._children.call(i, request.method, target, body, headers) for i in range(len(self._children.paths))
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        replies = [a for a in answers if not isinstance(a, BaseException)]
        if len(replies) == len(answers):
            statuses = {status for status, _, _ in replies}
            if all(200 <= status < 300 for status in statuses):  # applied everywhere (200 or 201: created somewhere)
                if request.path == "/peers/routes":
                    return _peer_answer(replies, self._settings.peers.secret, headers.get(auth.NONCE, ""))
                status, raw, kept = max(replies, key=lambda r: r[0])
                return wire.Response(status=status, body=raw, headers=kept)
            if len(statuses) == 1:  # refused alike everywhere: nothing changed
                status, raw, kept = replies[0]
                return wire.Response(status=status, body=raw, headers=kept)
        told = "; ".join(f"process {i}: {_describe(a)}" for i, a in enumerate(answers))
        log.error("%s %s did not apply alike in every process: %s", request.method, request.path, told)
        raise RouterError(
            f"{request.method} {request.path} did not apply alike in every process of this router ({told}); "
            "the processes that answered 2xx applied it: retry (the lifecycle calls are idempotent) or restart the pod",
            code="processes_disagree",
            status=502,
        )

    async def _metrics(self) -> wire.Response:
        calls = [self._children.call(i, "GET", "/metrics") for i in range(len(self._children.paths))]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        texts = []
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException) or answer[0] != 200:
                raise RouterError(
                    f"process {i} gave no metrics: {_describe(answer)}", code="process_unavailable", status=503
                )
            texts.append(answer[1])
        return wire.Response(body=merge_expositions(texts), headers={"Content-Type": CONTENT_TYPE})


def _peer_answer(replies: list[tuple[int, bytes, dict[str, str]]], secret: str | None, nonce: str) -> wire.Response:
    """``POST /peers/routes`` answered for the pod: every process applied the batch (``messages.merge_answers``); the
    merged answer signed as each process signed its own (``--peer-secret``)."""
    body = orjson.dumps(messages.merge_answers([raw for _, raw, _ in replies]))
    headers = {auth.SIGNATURE: auth.sign_answer(secret.encode(), nonce, body)} if secret else None
    return wire.Response(body=body, content_type="application/json", headers=headers)


def child_argv(argv: Sequence[str], settings: Settings, directory: str, index: int) -> list[str]:
    """A child's command line: the parent's, then its number and the pod's (the last of a flag given twice wins)."""
    p = settings.process
    return [
        *(sys.executable, "-m", "smg_router", *argv),
        *("--processes", str(p.count), "--processes-dir", directory, "--process-index", str(index)),
    ]


async def _answers(children: Children, index: int, process: asyncio.subprocess.Process) -> bool:
    """Child ``index`` answers on its socket (False: it exited first)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_SECONDS
    while process.returncode is None and loop.time() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if (await children.call(index, "GET", "/liveness"))[0] == 200:
                return True
        await asyncio.sleep(0.05)
    return False


async def supervise(settings: Settings, argv: Sequence[str]) -> int:
    """Run the pod: start the children, serve the admin port and the children's calls, stop them all on SIGTERM.
    The exit status: 0 when every child exited 0 on SIGTERM, else 1."""
    p, s = settings.process, settings.server
    directory = p.dir or tempfile.mkdtemp(prefix="smg-router-")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name in [POD_SOCKET, *(child_socket(i) for i in range(p.count))]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))  # a previous run's
    children = Children(directory, p.count)
    pod = Pod(settings, children)
    server = Server(pod, max_body=messages.BODY_LIMIT, body_timeout=s.body_timeout, closing=lambda: pod.stopping)
    await server.listen_unix(os.path.join(directory, POD_SOCKET))
    processes: list[asyncio.subprocess.Process] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    status = 1
    try:
        for i in range(p.count):
            argv_i = child_argv(argv, settings, directory, i)
            processes.append(await asyncio.create_subprocess_exec(*argv_i, stdin=asyncio.subprocess.DEVNULL))
        started = await asyncio.gather(*(_answers(children, i, proc) for i, proc in enumerate(processes)))
        if not all(started):
            log.error("process(es) %s did not start: stopping", [i for i, ok in enumerate(started) if not ok])
        elif stop.is_set():
            status = 0
        else:
            if s.admin_port:
                await server.listen(s.host, s.admin_port)
            log.info(
                "smg-router serving on http://%s:%d with %d processes (pids %s)%s; their sockets in %s",
                s.host,
                s.port,
                p.count,
                " ".join(str(proc.pid) for proc in processes),
                f", worker lifecycle changes on port {s.admin_port}" if s.admin_port else "",
                directory,
            )
            status = await _watch(processes, stop)
    finally:
        pod.stopping = True
        status = await _stop(processes, settings, status)
        await server.shutdown(1.0)
        await children.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if p.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    log.info("every process stopped: exiting %d", status)
    return status


async def _watch(processes: list[asyncio.subprocess.Process], stop: asyncio.Event) -> int:
    """Until SIGTERM (0) or a child's exit (1, logged)."""
    stopped = asyncio.ensure_future(stop.wait())
    exits = {asyncio.ensure_future(proc.wait()): i for i, proc in enumerate(processes)}
    done, _ = await asyncio.wait([stopped, *exits], return_when=asyncio.FIRST_COMPLETED)
    for task in [stopped, *exits]:
        task.cancel()
    if stopped in done:
        return 0
    for i, proc in enumerate(processes):
        if proc.returncode is not None:
            log.error("process %d (pid %d) exited with status %d: stopping the others", i, proc.pid, proc.returncode)
    return 1


async def _stop(processes: list[asyncio.subprocess.Process], settings: Settings, status: int) -> int:
    """SIGTERM to every child still running (each drains: --shutdown-delay, then --shutdown-timeout), then wait for
    them, killing those past the bound; ``status``, or 1 when one of them did not exit 0."""
    for proc in processes:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    s = settings.server
    bound = s.shutdown_delay + s.shutdown_timeout + STOP_GRACE
    deadline = asyncio.get_running_loop().time() + bound
    for i, proc in enumerate(processes):
        try:
            code = await asyncio.wait_for(proc.wait(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            log.error("process %d (pid %d) still running %.0f s after SIGTERM: killed", i, proc.pid, bound)
            proc.kill()
            code = await proc.wait()
        if code != 0:
            status = 1
    return status
