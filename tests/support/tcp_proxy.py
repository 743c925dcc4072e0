"""A TCP proxy on loopback that can cut a client off from its upstream without killing either: a partition.

``cut()`` black-holes: connections, open or new, are accepted and read, but nothing is forwarded either way, so
the client's calls hang until its own timeouts fire (neither a refusal nor a reset, which a client notices at
once).  ``restore()`` forwards new connections again and closes the black-holed ones, as a healed network whose
old connections time out: what was sent into the hole is never delivered late.  TLS passes through untouched.
``delay``: every chunk is forwarded that many seconds late, either way (a slow link between two nodes).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

__all__ = ["CuttableProxy"]


class _Pair:
    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.holed = False
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        for s in (self.client, self.upstream):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()


class CuttableProxy:
    """127.0.0.1:``port`` → ``upstream`` (host, port); one thread per connection (tests open few)."""

    def __init__(self, upstream: tuple[str, int], *, delay: float = 0.0) -> None:
        self.upstream = upstream
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._cut = False
        self._lock = threading.Lock()
        self._pairs: set[_Pair] = set()
        self._stopped = threading.Event()
        self.accepted = 0
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            for pair in self._pairs:
                pair.holed = True

    def restore(self) -> None:
        with self._lock:
            self._cut = False
            holed = [p for p in self._pairs if p.holed]
        for pair in holed:
            pair.close()

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            pair.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            pair = _Pair(client)
            with self._lock:
                self.accepted += 1
                pair.holed = self._cut
                self._pairs.add(pair)
            threading.Thread(target=self._serve, args=(pair,), daemon=True).start()

    def _serve(self, pair: _Pair) -> None:
        try:
            if not pair.holed:
                try:
                    pair.upstream = socket.create_connection(self.upstream, timeout=5)
                except OSError:
                    return
            self._pump(pair)
        finally:
            pair.close()
            with self._lock:
                self._pairs.discard(pair)

    def _pump(self, pair: _Pair) -> None:
        while not (self._stopped.is_set() or pair.closed.is_set()):
            socks = [s for s in (pair.client, pair.upstream) if s is not None]
            try:
                readable, _, _ = select.select(socks, [], [], 0.1)
            except (OSError, ValueError):
                return
            for s in readable:
                try:
                    data = s.recv(65536)
                except OSError:
                    return
                if not data:
                    if s is pair.upstream and pair.holed:  # a hole does not tell the client
                        with contextlib.suppress(OSError):
                            s.close()
                        pair.upstream = None
                        continue
                    return  # the client hung up (its timeout), or the upstream did while forwarding
                if pair.holed:
                    continue  # swallowed: never forwarded, now or later
                other = pair.upstream if s is pair.client else pair.client
                if self.delay:
                    time.sleep(self.delay)
                try:
                    assert other is not None
                    other.sendall(data)
                except OSError:
                    return
