"""Fixtures shared by the operator's unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """The HTTP session a ``RouterClient`` under test calls routers with."""
    async with aiohttp.ClientSession() as s:
        yield s
