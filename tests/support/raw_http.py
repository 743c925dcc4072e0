"""Reading one HTTP/1.1 request off a raw socket, for test servers that answer with hand-made bytes."""

from __future__ import annotations

import asyncio


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """Consume one request (head and Content-Length body); return its path."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    await reader.readexactly(length)
    return head.split(b" ")[1]
