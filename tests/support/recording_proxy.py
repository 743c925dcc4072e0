"""A TCP proxy on a pod's address that records every byte clients send before forwarding it to a real server.

It stands in front of a process (a tenant's own ``smg-router``) to show what reached it, the admin token included:
a test reads ``requests()`` (method, path, headers) or ``connections`` (zero means nothing was ever sent).
"""

from __future__ import annotations

import contextlib
import re
import socket
import socketserver
import threading
from dataclasses import dataclass

REQUEST_LINE = re.compile(rb"(GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS) (\S+) HTTP/1\.[01]\r\n((?:[^\r\n]+\r\n)*)\r\n")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class RecordingProxy:
    def __init__(self, host: str, port: int, upstream: tuple[str, int]) -> None:
        self.host, self.port, self.upstream = host, port, upstream
        self._lock = threading.Lock()
        self._sent: list[bytearray] = []
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._pump(self.request)

        self._server = _Server((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"proxy-{host}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> RecordingProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._sent)

    def requests(self) -> list[Request]:
        """Every HTTP request clients sent through the proxy, in order."""
        with self._lock:
            streams = [bytes(b) for b in self._sent]
        out = []
        for data in streams:
            for m in REQUEST_LINE.finditer(data):
                headers = {}
                for line in m.group(3).decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name:
                        headers[name.strip().lower()] = value.strip()
                out.append(Request(m.group(1).decode(), m.group(2).decode("latin-1"), headers))
        return out

    def _pump(self, client: socket.socket) -> None:
        sent = bytearray()
        with self._lock:
            self._sent.append(sent)
        with contextlib.suppress(OSError), socket.create_connection(self.upstream, timeout=30) as upstream:
            back = threading.Thread(target=_copy, args=(upstream, client, None, self._lock), daemon=True)
            back.start()
            _copy(client, upstream, sent, self._lock)
            back.join(timeout=30)


def _copy(src: socket.socket, dst: socket.socket, record: bytearray | None, lock: threading.Lock) -> None:
    with contextlib.suppress(OSError):
        while chunk := src.recv(65536):
            if record is not None:
                with lock:
                    record.extend(chunk)
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
