"""upstream: sending a request to a worker.  ``base`` is the interface; each transport sits beside it."""

from smg_router.upstream.base import ResponseLimits, ResponseTooLarge, Timeouts, UpstreamConnectError, UpstreamResponse
from smg_router.upstream.client import Upstream

__all__ = ["ResponseLimits", "ResponseTooLarge", "Timeouts", "Upstream", "UpstreamConnectError", "UpstreamResponse"]
