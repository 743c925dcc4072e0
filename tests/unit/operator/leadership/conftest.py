"""The elector's tests run on virtual time: lease durations, renew deadlines and hanging calls are exact
loop time, not a race against a shared machine's clock (no socket I/O in this folder)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
from support.virtual_time import VirtualTimeEventLoop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"virtual-time": VirtualTimeEventLoop}
