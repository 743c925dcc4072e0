"""The fleet's capacity in requests per simulated second, derived from the sim's cost model (no measurement).

The sim prefills a worker's admitted requests one batch at a time at ``prefill_tps`` uncached tokens/s (prefill
has priority, so prefills are effectively serial) and decodes all running requests together, one token per step
of ``decode_step_ms + decode_step_ms_per_req * batch``.  A worker runs at most ``max_running`` requests and no
more than fit its KV (each reserves prompt + max_tokens), so at saturation it holds ``batch = min(max_running,
kv_capacity // (prompt + max_tokens))`` and spends per request ``uncached / prefill_tps + max_tokens * step /
batch`` seconds.  The capacity is the number of workers over that, with means over the plan.

Basis ``cold``: every prompt token is prefilled (no cache hit at all), the capacity any policy can sustain.
Basis ``oracle``: only the oracle's uncached tokens are prefilled, the capacity of perfect routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """The sim flags that set its speed (``smg-sim --help``; defaults are the sim's)."""

    prefill_tps: float = 4000.0
    decode_step_ms: float = 15.0
    decode_step_ms_per_req: float = 0.3
    max_running: int = 16
    kv_capacity: int = 7000
    cache_on: str = "prefill"
    """When a prompt enters the engine's prefix cache: after its prefill (SGLang) or when scheduled (vLLM)."""

    def batch(self, tokens_per_request: float) -> int:
        """Requests a worker runs at once at saturation (memory-bound or slot-bound)."""
        return max(1, min(self.max_running, int(self.kv_capacity // max(tokens_per_request, 1.0))))

    def seconds_per_request(self, *, prompt: float, uncached: float, max_tokens: float) -> float:
        """Simulated worker time one request costs at saturation."""
        b = self.batch(prompt + max_tokens)
        step_s = (self.decode_step_ms + self.decode_step_ms_per_req * b) / 1000.0
        return uncached / self.prefill_tps + max_tokens * step_s / b


def fleet_capacity(
    cost: CostModel, *, workers: int, prompts: Sequence[int], uncached: Sequence[int], max_tokens: Sequence[int]
) -> float:
    """Requests per simulated second the fleet serves at saturation (means over the plan's requests)."""
    n = len(prompts)
    per_request = cost.seconds_per_request(
        prompt=sum(prompts) / n, uncached=sum(uncached) / n, max_tokens=sum(max_tokens) / n
    )
    return workers / per_request
