"""kv_events: what the engines say their KV caches store and evict (below the fleet; no policy, no request path)."""

from .decode import Cleared, Event, EventBatch, InvalidBatch, Removed, Stored, decode_batch

__all__ = ["Cleared", "Event", "EventBatch", "InvalidBatch", "Removed", "Stored", "decode_batch"]
