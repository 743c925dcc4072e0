"""Load reports of the engine in the two formats routers scrape: SGLang's /v1/loads JSON and a
Prometheus text exposition with SGLang's metric names.

Pure functions of an `EngineStats` snapshot, written by hand (no prometheus_client registry, so several
in-process workers never share global metric state).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .engine import EngineStats

# (name, type, help, value getter)
_METRICS: tuple[tuple[str, str, str, Any], ...] = (
    ("sglang:num_running_reqs", "gauge", "Number of running requests.", lambda s: s.num_running_reqs),
    ("sglang:num_queue_reqs", "gauge", "Number of requests in the waiting queue.", lambda s: s.num_waiting_reqs),
    ("sglang:num_used_tokens", "gauge", "KV cache tokens held by running requests.", lambda s: s.num_used_tokens),
    ("sglang:max_total_num_tokens", "gauge", "KV cache capacity in tokens.", lambda s: s.max_total_num_tokens),
    ("sglang:token_usage", "gauge", "Fraction of the KV cache held by running requests.", lambda s: s.token_usage),
    ("sglang:cache_hit_rate", "gauge", "Fraction of prompt tokens served from the prefix cache.",
     lambda s: s.cache_hit_rate),
    ("sglang:gen_throughput", "gauge", "Generation throughput in tokens per second.", lambda s: s.gen_throughput),
    ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
     lambda s: s.prompt_tokens_total),
    ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
     lambda s: s.generation_tokens_total),
    ("sglang:cached_tokens_total", "counter", "Number of prompt tokens served from the prefix cache.",
     lambda s: s.cached_tokens_total),
    ("sglang:num_requests_total", "counter", "Number of generation requests received by the engine.",
     lambda s: s.requests_total),
)


def loads_report(stats: EngineStats) -> dict[str, Any]:
    """SGLang's /v1/loads body for a single data-parallel rank."""
    return {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(),
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": stats.num_running_reqs,
            "num_waiting_reqs": stats.num_waiting_reqs,
            "num_used_tokens": stats.num_used_tokens,
            "max_total_num_tokens": stats.max_total_num_tokens,
            "token_usage": round(stats.token_usage, 6),
            "gen_throughput": round(stats.gen_throughput, 3),
            "cache_hit_rate": round(stats.cache_hit_rate, 6),
            "utilization": round(stats.utilization, 6),
        }],
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value))


def prometheus_text(stats: EngineStats, *, model: str) -> str:
    """Prometheus text format 0.0.4, every sample labelled with `model_name`."""
    labels = f'{{model_name="{_label(model)}"}}'
    lines = []
    for name, kind, help_text, get in _METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{labels} {_number(get(stats))}")
    return "\n".join(lines) + "\n"
