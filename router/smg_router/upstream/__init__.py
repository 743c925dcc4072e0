"""upstream: sending a request to a worker.  ``base`` is the interface; each transport sits beside it."""

from smg_router.upstream.base import Timeouts, UpstreamConnectError, UpstreamResponse
from smg_router.upstream.client import Upstream

__all__ = ["Timeouts", "Upstream", "UpstreamConnectError", "UpstreamResponse"]
