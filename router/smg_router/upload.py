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
from smg_router.errors import BadRequest, PayloadTooLarge, RequestTimeout


class BodyStream(Protocol):
    """The client's body as it arrives (``wire.Request.content``)."""

    async def readany(self) -> bytes: ...


HEAD_LIMIT = 64 * 1024
"""The form fields before the file part must fit in this many bytes."""
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
    delim = b"--" + boundary
    pos = buf.find(delim)
    fields: dict[str, str] = {}
    while pos >= 0:
        start = pos + len(delim)
        if len(buf) < start + 2:
            return fields, False
        if buf[start : start + 2] == b"--":
            return fields, True  # the closing delimiter: a form without a file
        headers_end = buf.find(b"\r\n\r\n", start)
        if headers_end < 0:
            return fields, False
        headers = buf[start:headers_end].decode("latin-1")
        if _FILENAME.search(headers):
            return fields, True
        end = buf.find(b"\r\n" + delim, headers_end + 4)
        if end < 0:
            return fields, False
        name = _NAME.search(headers)
        if name is not None:
            fields.setdefault(name.group(1), buf[headers_end + 4 : end].decode("utf-8", "replace"))
        pos = end + 2
    return fields, False


class StreamedUpload:
    """The client's body as the worker gets it: the head read so far, then the rest as it arrives."""

    __slots__ = ("_content", "_sent", "failure", "fields", "head", "limit")

    def __init__(self, content: BodyStream, *, limit: int) -> None:
        self._content = content
        self.limit = limit
        self._sent = 0
        self.head = b""
        self.fields: dict[str, str] = {}
        self.failure: PayloadTooLarge | RequestTimeout | None = None
        """Set when the client's side failed (the body passed ``limit``: 413; it stopped arriving: 408): the
        worker's side then failed because of us, and this is the answer."""

    @property
    def replayable(self) -> bool:
        """Nothing beyond the kept head was read from the client: another worker can get the whole body."""
        return self._sent == 0

    async def read_head(self, boundary: bytes) -> None:
        """Read until the head is over (or the body ends); 400 when the head is too long to hold."""
        done = False
        while not done:
            chunk = await self._read()
            if not chunk:
                break
            self.head += chunk
            self.fields, done = scan_head(self.head, boundary)
            if not done and len(self.head) > HEAD_LIMIT:
                raise BadRequest(
                    f"the form fields before the file part exceed {HEAD_LIMIT} bytes", code="invalid_multipart"
                )
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

    async def _read(self) -> bytes:
        try:
            return await self._content.readany()
        except wire.BodyTimeout as e:
            self.failure = RequestTimeout.of_body(e)
            raise self.failure from None
