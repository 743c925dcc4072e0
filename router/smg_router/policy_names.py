"""Policy names and their aliases: imports nothing, so settings and the policy factory can both use it."""

from __future__ import annotations

POLICY_NAMES = ("random", "round_robin", "power_of_two", "least_load", "cache_aware")
ALIASES = {
    "cacheaware": "cache_aware",
    "cache": "cache_aware",
    "roundrobin": "round_robin",
    "rr": "round_robin",
    "poweroftwo": "power_of_two",
    "power_of_2": "power_of_two",
    "p2c": "power_of_two",
    "leastload": "least_load",
    "least_loaded": "least_load",
    "shortest_queue": "least_load",
}


def canonical_name(name: str) -> str:
    """``Cache-Aware``, ``cacheaware`` and ``cache_aware`` all name the same policy; ValueError otherwise."""
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    return key
