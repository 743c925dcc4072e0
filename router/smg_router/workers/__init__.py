"""workers: the worker model, the registry, health checks, the load monitor and the one lifecycle path."""
