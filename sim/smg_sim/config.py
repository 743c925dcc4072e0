"""Configuration of one simulated worker.

`SimConfig` is the single source of truth shared by the CLI (`__main__`), the in-process API
(`start_sim`) and every component (engine, HTTP API, bootstrap server). Durations that model GPU
work are multiplied by `time_scale`; wall-clock behaviours (slow start, bootstrap long-poll, room
expiry) are not, because they exist to exercise timeouts in the code under test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["regular", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("regular", "prefill", "decode")
VllmPD = Literal["off", "prefill", "decode"]
VLLM_PD_ROLES: tuple[VllmPD, ...] = ("off", "prefill", "decode")
KvEventsFormat = Literal["vllm", "vllm-array", "sglang", "sglang-array"]
KV_EVENTS_FORMATS: tuple[KvEventsFormat, ...] = ("vllm", "vllm-array", "sglang", "sglang-array")
CacheOn = Literal["prefill", "schedule"]
CACHE_ON: tuple[CacheOn, ...] = ("prefill", "schedule")

#: Default port of the prefill bootstrap server, the same as SGLang's `--disaggregation-bootstrap-port`.
DEFAULT_BOOTSTRAP_PORT = 8998


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything that shapes the behaviour of one smg-sim worker."""

    host: str = "127.0.0.1"
    """Address to listen on (any 127.x.y.z works for multi-worker setups on one machine)."""

    port: int = 30000
    """Port to listen on; 0 picks a free one (read it back from `SimServer.url`)."""

    model: str = "smg-sim-model"
    """Served model name: reported by /v1/models and required to match OpenAI requests' `model`."""

    role: Role = "regular"
    """`regular` serves end to end; `prefill`/`decode` model SGLang PD disaggregation."""

    bootstrap_port: int | None = None
    """Port of the prefill bootstrap server (prefill role only); None means 8998, 0 a free port.  With
    ``vllm_pd="prefill"`` the KV side channel's port instead; None means 5600, vLLM's default."""

    vllm_pd: VllmPD = "off"
    """vLLM PD role (``kv_transfer_params``, ``vllm_pd`` module); ``role`` stays ``regular``, as the two
    PD protocols do not mix."""

    time_scale: float = 1.0
    """Multiplier on every simulated duration (prefill, decode steps); 0.01 runs 100x faster."""

    max_running: int = 16
    """Continuous-batching limit: at most this many requests run, the rest wait FIFO."""

    kv_capacity: int = 200_000
    """KV cache size in tokens: bounds running requests' memory and the prefix cache."""

    prefill_tps: float = 4000.0
    """Prefill speed in uncached prompt tokens per simulated second."""

    decode_step_ms: float = 15.0
    """Base duration of one decode batch step in simulated milliseconds."""

    decode_step_ms_per_req: float = 0.3
    """Extra step time per running request, so bigger batches decode each token a bit slower."""

    max_tokens_default: int = 16
    """Completion length when a request does not say `max_tokens` / `max_new_tokens`."""

    error_rate: float = 0.0
    """Fraction of generation requests answered with a simulated error (``error_status``)."""

    error_status: int = 500
    """The status of those answers: 500 a broken engine, 503 an overloaded one, 429 one that sheds load."""

    hang_rate: float = 0.0
    """Fraction of generation requests that never answer (until the client disconnects)."""

    slow_start: float = 0.0
    """Wall-clock seconds after start during which /health answers 503."""

    crash_after: int | None = None
    """Exit the process (status 1) on receiving this many-th generation request; None disables."""

    seed: int | None = None
    """Seed for the fault-injection random generator; None draws one from the OS."""

    log_level: str = "info"
    """Python logging level name for the CLI."""

    bootstrap_timeout: float = 10.0
    """Wall-clock ceiling of the bootstrap long-poll, and how long a decode worker waits for a room."""

    room_ttl: float = 60.0
    """Wall-clock seconds a finished bootstrap room stays fetchable."""

    stream_head_first: bool = False
    """Decode role: an OpenAI stream's head (200, ``text/event-stream``) goes out before the KV arrived from the
    prefill worker, as SGLang's decode server sends it; a failed transfer is then an error event in the stream."""

    cache_on: CacheOn = "prefill"
    """When a prompt enters the prefix cache.  ``prefill``: once its prefill is done, as SGLang's radix cache
    inserts it, so requests admitted together with it prefill it each.  ``schedule``: in the step that schedules
    it, as vLLM's block manager caches a block when it allocates it, so every request scheduled with it or after
    it shares its prefix, and its KV events are published before its prefill ends."""

    block_size: int = 16
    """Tokens per KV block, the unit KV events announce (vLLM's default block size)."""

    kv_events_endpoint: str | None = None
    """ZeroMQ address the KV-event PUB socket binds (``tcp://127.0.0.1:5557``; port ``*``: any free one); None:
    no events, and no work spent on them."""

    kv_events_replay_endpoint: str | None = None
    """ZeroMQ address of the replay ROUTER socket (needs ``kv_events_endpoint``); None: no replay."""

    kv_events_topic: str = ""
    """Topic frame of every KV-event message."""

    kv_events_buffer_steps: int = 10_000
    """Batches the replay socket keeps (vLLM's and SGLang's ``buffer_steps`` default)."""

    kv_events_format: KvEventsFormat = "vllm"
    """Whose wire format the events take: ``vllm`` (tagged maps), ``vllm-array`` (positional, before vLLM's
    switch to maps), ``sglang`` (tagged maps) or ``sglang-array`` (positional)."""

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid SimConfig: " + "; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if self.role not in ROLES:
            yield f"role must be one of {ROLES}, got {self.role!r}"
        if self.vllm_pd not in VLLM_PD_ROLES:
            yield f"vllm_pd must be one of {VLLM_PD_ROLES}, got {self.vllm_pd!r}"
        elif self.vllm_pd != "off" and self.role != "regular":
            yield "vllm_pd (vLLM's kv_transfer_params) and role prefill/decode (SGLang's bootstrap) do not mix"
        if not 0 <= self.port <= 65535:
            yield f"port out of range: {self.port}"
        if self.bootstrap_port is not None and not 0 <= self.bootstrap_port <= 65535:
            yield f"bootstrap_port out of range: {self.bootstrap_port}"
        if not self.model:
            yield "model must not be empty"
        if self.time_scale < 0:
            yield "time_scale must be >= 0"
        if self.max_running < 1:
            yield "max_running must be >= 1"
        if self.kv_capacity < 1:
            yield "kv_capacity must be >= 1"
        if self.prefill_tps <= 0:
            yield "prefill_tps must be > 0"
        if self.decode_step_ms < 0 or self.decode_step_ms_per_req < 0:
            yield "decode step times must be >= 0"
        if self.max_tokens_default < 1:
            yield "max_tokens_default must be >= 1"
        for name in ("error_rate", "hang_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                yield f"{name} must be within [0, 1], got {value}"
        if not 400 <= self.error_status <= 599:
            yield f"error_status must be a 4xx or 5xx status, got {self.error_status}"
        if self.slow_start < 0:
            yield "slow_start must be >= 0"
        if self.crash_after is not None and self.crash_after < 1:
            yield "crash_after must be >= 1 (or None)"
        if self.bootstrap_timeout <= 0 or self.room_ttl <= 0:
            yield "bootstrap_timeout and room_ttl must be > 0"
        if self.block_size < 1:
            yield "block_size must be >= 1"
        if self.cache_on not in CACHE_ON:
            yield f"cache_on must be one of {CACHE_ON}, got {self.cache_on!r}"
        if self.kv_events_format not in KV_EVENTS_FORMATS:
            yield f"kv_events_format must be one of {KV_EVENTS_FORMATS}, got {self.kv_events_format!r}"
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            yield "kv_events_replay_endpoint needs kv_events_endpoint"

    @property
    def effective_bootstrap_port(self) -> int | None:
        """The bootstrap port a prefill worker binds (None for other roles)."""
        if self.role != "prefill":
            return None
        return DEFAULT_BOOTSTRAP_PORT if self.bootstrap_port is None else self.bootstrap_port

    @property
    def disaggregation_mode(self) -> str:
        """SGLang's name for the role: "null", "prefill" or "decode"."""
        return "null" if self.role == "regular" else self.role

    def replace(self, **changes: Any) -> SimConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict of all fields, for /get_server_info."""
        return dataclasses.asdict(self)
