"""smg_router: the cache-aware LLM router (data plane, lifecycle hooks, policies, metrics)."""

__version__ = "0.1.0"
