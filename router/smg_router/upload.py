"""A multipart upload streamed through the router (``/v1/audio/transcriptions``), never held whole.

The router reads only the form's head: the parts before the first file part (at most ``HEAD_LIMIT``
bytes), where the client names the ``model`` (and ``stream``).  The official clients send the plain
fields before the file (httpx writes data fields first), so the model routes the request; a form whose
file part comes first routes by the default model (the only one the router serves, else a 400 saying to
put ``model`` before the file).  The head is kept, so a worker that cannot be reached is retried with it;
the rest is pulled from the client as the worker reads it.  Once any of the rest has been read the upload
cannot be sent again: from then on a worker's failure is the client's answer, not a retry.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Protocol

from smg_router import wire
from smg_router.errors import BadRequest, Overloaded, PayloadTooLarge, RequestTimeout, shed


class BodyStream(Protocol):
    """The client's body as it arrives (``wire.Request.content``)."""

    async def readany(self, at_least: int = 1) -> bytes: ...

    def hold(self, size: int) -> None:
        """Count ``size`` bytes taken and kept (the head) in the router's body budget until the request ends."""
        ...


HEAD_LIMIT = 64 * 1024
"""The form fields before the file part must fit in this many bytes."""
HEAD_BATCH = 4096
"""While the head is read, bytes that wake its reader (fewer when the head limit is nearer): a head sent in tiny
pieces costs a wake-up per batch, and the head's end is seen at most this many bytes late."""
_NAME = re.compile(r'(?<![\w*])name="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(r"\bfilename\*?=", re.IGNORECASE)
_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)


def boundary_of(content_type: str) -> bytes:
    """The multipart boundary, or a 400 when the body is not ``multipart/form-data``."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest(
            f"this endpoint takes multipart/form-data, not {content_type or 'a body without Content-Type'}",
            code="invalid_content_type",
        )
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise BadRequest("the multipart/form-data Content-Type has no boundary", code="invalid_content_type")
    return (found.group(1) or found.group(2)).encode("latin-1")


def scan_head(buf: bytes, boundary: bytes) -> tuple[dict[str, str], bool]:
    """The plain fields complete in ``buf`` and whether the head is over (a file part or the form's end began)."""
    scanner = HeadScanner(boundary)
    done = scanner.feed(buf)
    return scanner.fields, done


class HeadScanner:
    """``scan_head`` fed piece by piece: each byte is searched about once, so a head that arrives in tiny pieces
    costs what it costs whole (a scan of everything so far at each piece grows with the square of the head)."""

    __slots__ = ("_delim", "_from", "_headers_end", "_pos", "buf", "done", "fields")

    def __init__(self, boundary: bytes) -> None:
        self._delim = b"--" + boundary
        self.buf = bytearray()
        self.fields: dict[str, str] = {}
        self.done = False
        self._pos = -1
        """Where the current part's delimiter starts (-1: the first one is not found yet)."""
        self._headers_end = -1
        """Where the current part's headers end (-1: not found yet)."""
        self._from = 0
        """Where the pending search goes on: bytes before it cannot start what it looks for."""

    def feed(self, chunk: bytes) -> bool:
        """Add the next bytes of the body; whether the head is over."""
        buf = self.buf
        buf += chunk
        delim = self._delim
        while not self.done:
            if self._pos < 0:
                found = buf.find(delim, self._from)
                if found < 0:
                    self._from = max(0, len(buf) - len(delim) + 1)
                    return False
                self._pos, self._from = found, found + len(delim)
            start = self._pos + len(delim)
            if self._headers_end < 0:
                if len(buf) < start + 2:
                    return False
                if buf[start : start + 2] == b"--":
                    self.done = True  # the closing delimiter: a form without a file
                    break
                found = buf.find(b"\r\n\r\n", max(start, self._from))
                if found < 0:
                    self._from = max(start, len(buf) - 3)
                    return False
                self._headers_end, self._from = found, found + 4
                if _FILENAME.search(bytes(buf[start:found]).decode("latin-1")):
                    self.done = True
                    break
            end = buf.find(b"\r\n" + delim, max(self._headers_end + 4, self._from))
            if end < 0:
                self._from = max(self._headers_end + 4, len(buf) - len(delim) - 1)
                return False
            headers = bytes(buf[start : self._headers_end]).decode("latin-1")
            name = _NAME.search(headers)
            if name is not None:
                value = bytes(buf[self._headers_end + 4 : end])
                self.fields.setdefault(name.group(1), value.decode("utf-8", "replace"))
            self._pos, self._headers_end, self._from = end + 2, -1, end + 2 + len(delim)
        return True


class StreamedUpload:
    """The client's body as the worker gets it: the head read so far, then the rest as it arrives."""

    __slots__ = ("_content", "_sent", "failure", "fields", "head", "limit")

    def __init__(self, content: BodyStream, *, limit: int) -> None:
        self._content = content
        self.limit = limit
        self._sent = 0
        self.head = b""
        self.fields: dict[str, str] = {}
        self.failure: PayloadTooLarge | RequestTimeout | Overloaded | None = None
        """Set when the client's side failed (the body passed ``limit``: 413; it stopped arriving or came too
        slowly: 408; it was shed over the router's body budget: 503): the worker's side then failed because of us,
        and this is the answer."""

    @property
    def replayable(self) -> bool:
        """Nothing beyond the kept head was read from the client: another worker can get the whole body."""
        return self._sent == 0

    async def read_head(self, boundary: bytes) -> None:
        """Read until the head is over (or the body ends); 400 when the head is too long to hold."""
        scanner = HeadScanner(boundary)
        done = False
        while not done:
            chunk = await self._read(min(HEAD_BATCH, HEAD_LIMIT + 1 - len(scanner.buf)))
            if not chunk:
                break
            self._content.hold(len(chunk))  # kept for a retry: counted until the request ends
            done = scanner.feed(chunk)
            if not done and len(scanner.buf) > HEAD_LIMIT:
                raise BadRequest(
                    f"the form fields before the file part exceed {HEAD_LIMIT} bytes", code="invalid_multipart"
                )
        self.head = bytes(scanner.buf)
        self.fields = scanner.fields
        if len(self.head) > self.limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {self.limit} bytes", code="payload_too_large")

    async def body(self) -> AsyncIterator[bytes]:
        """One attempt's body: the head, then what the client sends next (pulled only as the worker reads)."""
        yield self.head
        total = len(self.head) + self._sent
        while chunk := await self._read():
            total += len(chunk)
            self._sent += len(chunk)
            if total > self.limit:
                self.failure = PayloadTooLarge(
                    f"request body exceeds the limit of {self.limit} bytes", code="payload_too_large"
                )
                raise self.failure
            yield chunk

    async def _read(self, at_least: int = wire.READ_BATCH) -> bytes:
        """What arrived once ``at_least`` bytes did (or the body ended): a wake-up a batch, not a piece."""
        try:
            return await self._content.readany(at_least)
        except wire.BodyTimeout as e:
            self.failure = RequestTimeout.of_body(e)
            raise self.failure from None
        except wire.BodyOverBudget as e:
            self.failure = shed(e)
            raise self.failure from None
