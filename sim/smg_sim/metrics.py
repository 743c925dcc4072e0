"""Load reports of the engine in the two formats routers scrape: SGLang's /v1/loads JSON and a
Prometheus text exposition with SGLang's metric names.

Pure functions of an `EngineStats` snapshot, written by hand (no prometheus_client registry, so several
in-process workers never share global metric state).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .engine import EngineStats

# (name, type, EngineStats attribute, help)
_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("sglang:num_running_reqs", "gauge", "num_running_reqs", "Number of running requests."),
    ("sglang:num_queue_reqs", "gauge", "num_waiting_reqs", "Number of requests in the waiting queue."),
    ("sglang:num_used_tokens", "gauge", "num_used_tokens", "KV cache tokens held by running requests."),
    ("sglang:max_total_num_tokens", "gauge", "max_total_num_tokens", "KV cache capacity in tokens."),
    ("sglang:max_running_requests", "gauge", "max_running", "Maximum running requests."),
    ("sglang:token_usage", "gauge", "token_usage", "Fraction of the KV cache held by running requests."),
    ("sglang:cache_hit_rate", "gauge", "cache_hit_rate", "Fraction of prompt tokens served from the prefix cache."),
    ("sglang:gen_throughput", "gauge", "gen_throughput", "Generation throughput in tokens per second."),
    ("sglang:prompt_tokens_total", "counter", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("sglang:generation_tokens_total", "counter", "generation_tokens_total", "Number of generation tokens processed."),
    (
        "sglang:cached_tokens_total",
        "counter",
        "cached_tokens_total",
        "Number of prompt tokens served from the prefix cache.",
    ),
    ("sglang:num_requests_total", "counter", "requests_total", "Number of generation requests received by the engine."),
)


def loads_report(stats: EngineStats) -> dict[str, Any]:
    """SGLang's /v1/loads body for a single data-parallel rank."""
    return {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(),
        "dp_rank_count": 1,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": stats.num_running_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "num_used_tokens": stats.num_used_tokens,
                "max_total_num_tokens": stats.max_total_num_tokens,
                "token_usage": round(stats.token_usage, 6),
                "gen_throughput": round(stats.gen_throughput, 3),
                "cache_hit_rate": round(stats.cache_hit_rate, 6),
                "utilization": round(stats.utilization, 6),
                "max_running_requests": stats.max_running,
            }
        ],
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value))


def prometheus_text(stats: EngineStats, *, model: str, generation_requests: int | None = None) -> str:
    """Prometheus text format 0.0.4, every sample labelled with `model_name`; ``generation_requests``: the
    generation requests the worker received, those its faults answered included (``smg_sim_``, not an engine's)."""
    labels = f'{{model_name="{_label(model)}"}}'
    lines = []
    for name, kind, attr, help_text in _METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{labels} {_number(getattr(stats, attr))}")
    if generation_requests is not None:
        name = "smg_sim_generation_requests_total"
        lines.append(f"# HELP {name} Generation requests received, those answered by an injected fault included.")
        lines.append(f"# TYPE {name} counter")
        lines.append(f"{name}{labels} {_number(generation_requests)}")
    return "\n".join(lines) + "\n"
