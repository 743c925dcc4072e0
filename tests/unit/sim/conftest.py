"""The simulated engine's tests run on virtual time: its prefill and decode sleeps cost no wall time,
and time to first token is exact model time rather than a race against a shared machine's clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
from support.virtual_time import VirtualTimeEventLoop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"virtual-time": VirtualTimeEventLoop}
