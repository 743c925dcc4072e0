"""kv_events: what the engines say their KV caches store and evict (below the fleet; no policy, no request path)."""

from .decode import Cleared, Event, EventBatch, InvalidBatch, Removed, Stored, decode_batch
from .subscriber import KINDS, Counts, Subscriber

__all__ = [
    "KINDS",
    "Cleared",
    "Counts",
    "Event",
    "EventBatch",
    "InvalidBatch",
    "Removed",
    "Stored",
    "Subscriber",
    "decode_batch",
]
