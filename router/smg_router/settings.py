"""Command line and environment → grouped, immutable settings.

Every flag ``--foo-bar`` can also be set as ``SMG_FOO_BAR`` (Kubernetes passes configuration through
the environment); a flag on the command line wins over the environment.  The groups are handed to
the parts that need them: ``PolicySettings`` to every policy through the one factory, ``LoadSettings``
to the load monitor, and so on.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from smg_router.policy_names import POLICY_NAMES, canonical_name
from smg_router.workers.worker import KvEventsSpec, SpecError, normalize_url


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    """What every policy instance is built with, whatever slot or alias created it."""

    name: str = "cache_aware"
    """Default policy for regular workers (and for PD slots not given their own)."""
    cache_threshold: float = 0.3
    """A match is a hit only when matched_chars / len(text) is strictly greater than this."""
    balance_rel_threshold: float = 1.5
    """A worker is over the load gate when requests already wait for a running slot there, another worker would
    make it wait less, and its load is greater than the least load times this (``placement.within_gate``)."""
    tree_memory_budget: int = 256 * 2**20
    """Estimated bytes all the cache-aware trees of the router may hold together (every policy instance,
    every model); past it every worker of every tree is LRU-evicted by the same fraction, down to 80%.
    A char costs 2-40 bytes (long shared prompts to short unique ones; over 150 when many workers hold
    every node), so a cap in chars alone does not bound memory.  256 MiB fits the chart's 1 GiB limit beside the
    request bodies (--max-inflight-bytes 128 MiB, ~4x that while parsed) and the runtime (~100 MiB)."""
    placement_prefix_chars: int = 1024
    """A prompt nobody holds goes to the worker its leading this many chars rank first (rendezvous hashing
    over the routable workers, under the load gate): every router replica places a new prefix on the same
    worker without talking to the others.  Long enough to tell conversations and prompt groups apart past a
    shared system prompt, short enough to be the same for every request of a group."""
    index_complete: bool = True
    """Whether this router's cache index holds what the whole fleet was sent: it is the only replica
    (``--router-replicas 1``, one process) or its replicas tell it their routes (peers).  Else a miss is placed by
    rendezvous rank alone: room, prompts held and prefills judged from one replica's part of the traffic are judged
    differently by each replica, and a group they place apart is cached twice."""
    tree_chars_per_token: float = 3.0
    """A worker's share of a tree is capped at its engine's KV capacity in tokens (``max_total_num_tokens``
    from ``/v1/loads`` or ``/metrics``) times this, so the router forgets a prefix about when the engine
    does.  On the low side of English text (~4 chars a token): forgetting early costs little, since a
    forgotten prefix is placed by rendezvous on the worker that most likely still holds it.  0: no cap."""
    prefill_hold_seconds: float = 10.0
    """A burst on one new prefix: the requests routed to the worker that takes its first streamed request wait, at
    most this long, until that request's answer starts (the engine then holds the prefix: they prefill only their
    own tails instead of the whole prefix each, at once), ``coordination.Holds``.  0: nobody waits."""
    prefill_claim_seconds: float = 0.05
    """With peers in sync: how long at most a request that would lead the first prefill of a new prefix waits for the
    peers' answers to its claim (one round trip, usually: a burst reaches every replica at once, and one of them
    leads; ``coordination.Holds``).  A lead of the replica with the lowest id does not wait.  0: no claims (each replica
    may lead its own)."""
    prefill_claim_min_chars: int = 1024
    """A lead claims only when its worker is to prefill at least this many chars of its prompt (what the tree says
    the worker does not hold): a shorter prefill done twice costs the engine less than a claim's round trip costs."""
    prefill_policy: str | None = None
    """PD prefill slot policy; None means ``name``."""
    decode_policy: str | None = None
    """PD decode slot policy; None means ``name``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSettings:
    """The load monitor: the workers' global backlog, shared by every policy."""

    interval: float = 1.0
    """Seconds between polls of each worker's /v1/loads (or /metrics)."""
    timeout: float = 2.0
    """Timeout of one poll."""
    stale_after: float | None = None
    """A snapshot entry older than this is not used; None means 3 intervals + 1 s."""

    @property
    def max_age(self) -> float:
        return self.stale_after if self.stale_after is not None else 3 * self.interval + 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthSettings:
    """Active health checks of every worker."""

    interval: float = 5.0
    timeout: float = 3.0
    failure_threshold: int = 3
    """Consecutive failed probes before a ready worker becomes not_ready."""
    success_threshold: int = 1
    """Consecutive good probes before a pending or not_ready worker becomes ready."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrySettings:
    """Retries on another worker, only while nothing was sent to the client."""

    max_retries: int = 2
    backoff_initial: float = 0.05
    backoff_max: float = 1.0
    breaker_failure_threshold: int = 5
    """Consecutive failures that open a worker's circuit breaker."""
    breaker_cooldown: float = 10.0
    """Seconds an open breaker waits before letting one trial request through (half-open)."""
    budget_ratio: float = 0.2
    """Retries may be at most this share of the requests of the last ten seconds (``retry.RetryBudget``): a fleet
    failing every request sees about 1 + ratio attempts per request.  ``max_retries`` or more: no budget."""
    budget_min: int = 10
    """Retries the budget allows in any ten seconds whatever the traffic (a quiet router still retries)."""
    max_ejection_share: float = 0.5
    """Open breakers take at most this share of a model's workers out of routing; past it every worker of the
    model serves again (Envoy's max ejection percent, then its panic routing).  1.0: no bound."""

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1, 2, ...): doubling from backoff_initial up to backoff_max,
        jittered down to half so that retries of a burst do not arrive together (the regular and the PD path)."""
        delay: float = min(self.backoff_max, self.backoff_initial * 2 ** (attempt - 1))
        return delay * (0.5 + random.random() / 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldSettings:
    """Requests for a known model with no routable worker (scaled to zero, unhealthy, draining, not ready yet): how
    long they wait for one, and how many may (``waiting``)."""

    seconds: float = 0.0
    """How long such a request waits for a worker of its model to become routable before its 503; 0: the 503 at
    once.  A worker scaled from zero needs its pod started and its engine loaded: tens of seconds to minutes."""
    queue_size: int = 256
    """Requests that may wait per model (in each serving process); past it a 503 at once.  Each one holds its
    admission slot and its body while it waits, so the bound keeps a model's backlog well inside
    ``--max-concurrent-requests`` (1024) and ``--max-inflight-bytes``: four models at zero cannot take them all."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    admin_port: int = 0
    """Port of the lifecycle mutations (POST/PUT/PATCH/DELETE /workers, /add_worker, /remove_worker), on the
    same host; the main port then refuses them, so a NetworkPolicy can tell the two apart.  0: the main port."""
    max_payload_size: int = 8 * 1024 * 1024
    """Largest request body accepted (413 above): a long prompt is a few MB of JSON."""
    max_concurrent_requests: int = 1024
    """Generation requests answered at once; over it, 503 with Retry-After."""
    max_inflight_bytes: int = 128 * 1024 * 1024
    """Request body bytes held at once, counted as they arrive (never as declared), pipelined requests' included;
    a body whose bytes pass it is shed with a 503 and Retry-After.  Bodies cost about four times their size in
    memory while parsed."""
    max_connection_buffer: int = 1024 * 1024
    """Body bytes one connection may have waiting that no handler took yet (pipelined requests' included);
    reading from the client pauses above it."""
    body_timeout: float = 60.0
    """Longest a request body may go without a byte arriving (nginx's ``client_body_timeout``); past it the
    answer is a 408 and the connection closes, so a client that stalls (or vanished without a FIN) gives its
    admission slot back."""
    head_timeout: float = 20.0
    """A request's head (request line and headers) must be whole this many seconds after the connection opened or
    the head's first byte came (a 408 and the close past it); a body gets as long before its minimum rate counts."""
    body_min_rate: int = 500
    """Bytes a second a body must average once ``head_timeout`` has passed (Apache mod_reqtimeout's ``MinRate``:
    the deadline moves a second for every this many bytes); a slower body is a 408.  0: no minimum."""
    max_connections: int = 4096
    """Client connections served at once; a new one past it gets a 503 and is closed."""
    max_connections_per_client: int = 1024
    """Client connections from one address served at once; a new one past it gets a 503 and is closed."""
    max_response_header_size: int = 64 * 1024
    """Largest head (status line and headers) of a worker's answer; a larger one is a 502."""
    max_response_size: int = 64 * 1024 * 1024
    """Largest body of a worker's answer that is not streamed (the router reads it whole); a larger one is a
    502.  Streamed answers (SSE) pass through in pieces, unbounded."""
    request_timeout: float = 1800.0
    """Upper bound of one upstream request, streaming included."""
    first_byte_timeout: float = 300.0
    """Request sent to a worker → its response headers.  Past it the attempt fails like a connect error
    (retried on another worker while nothing reached the client, a 504 when none is left) and counts
    against the worker's breaker.  Generous: under load a long prompt's queueing + prefill takes tens of
    seconds, and engines (vLLM, SGLang, llama.cpp) send a non-streaming answer's headers only after its
    last token, so this also bounds a whole non-streaming generation; a stream's headers come at once."""
    stream_idle_timeout: float = 120.0
    """Longest silence between two pieces of a worker's response body, the wait for a stream's first
    token (queueing + prefill) included; time the router itself stops reading for a slow client does
    not count.  Past it a stream ends with an ``upstream_timeout`` error event and [DONE], a non-streaming
    answer is a 504."""
    connect_timeout: float = 5.0
    drain_timeout: float = 30.0
    """How long DELETE /workers/{id} waits for the worker's in-flight requests to finish."""
    shutdown_delay: float = 5.0
    """After SIGTERM: seconds of serving on (readiness already 503) while the endpoints drop the pod."""
    shutdown_timeout: float = 30.0
    """Then: seconds in-flight requests and streams get to finish before what is left is ended."""
    admin_api_key: str | None = None
    """Bearer token the lifecycle API requires for mutations; None leaves it open."""
    api_key: str | None = None
    """Bearer token the data plane (generation endpoints, /v1/models) requires; None leaves it open."""
    log_level: str = "info"


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingSettings:
    """What a request may say about where it goes: a session key header, and the model names it may use."""

    key_header: str = "x-smg-routing-key"
    """Request header whose value pins the request to a worker by rendezvous hashing over the routable workers
    of its model and role, under the load gate (``policies.sticky``); "" turns session keys off."""
    model_aliases: tuple[tuple[str, str], ...] = ()
    """(public name, served name) pairs: a request for the public name routes to the workers of the served one,
    and the body forwarded names the served model.  Chains are resolved here; cycles are refused."""
    tokenizers: tuple[tuple[str, str], ...] = ()
    """(model, path of its tokenizer.json or of the folder holding it and tokenizer_config.json): the router
    tokenizes that model's prompts, so its workers' KV events can be matched (``prompts``)."""
    kv_events: tuple[tuple[str, str, str | None], ...] = ()
    """(worker url, KV events endpoint, replay endpoint or None) of workers registered at start."""
    response_id_key: str = ""
    """The key of the worker tokens in Responses ids (``response_ids``); the same on every replica.  "": a fixed
    public key (tags are read by every replica, and are as opaque as the worker id)."""
    expose_worker_url: bool = False
    """Answers carry the worker's URL (``x-smg-routed-worker-id``) besides its opaque id: for debugging."""


def resolve_aliases(pairs: Sequence[tuple[str, str]], served: str | None = None) -> tuple[tuple[str, str], ...]:
    """The alias map with chains followed to a served name; ValueError naming the alias for one given twice
    with two targets, one equal to the served ``--model-id``, or a cycle."""
    table: dict[str, str] = {}
    for public, target in pairs:
        if not public or not target:
            raise ValueError(f"model alias {public}={target}: both names must be non-empty")
        if table.get(public, target) != target:
            raise ValueError(f"model alias {public} is given twice ({table[public]} and {target})")
        if public == served:
            raise ValueError(f"model alias {public} is the name of the served model (--model-id)")
        table[public] = target
    resolved: dict[str, str] = {}
    for public in table:
        seen, name = [public], table[public]
        while name in table:
            if name in seen:
                raise ValueError(f"model alias {public} is part of a cycle: {' -> '.join([*seen, name])}")
            seen.append(name)
            name = table[name]
        resolved[public] = name
    return tuple(resolved.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSettings:
    """The other replicas of this router, told every route so that each one's tree holds the fleet's
    (``coordination``)."""

    urls: tuple[str, ...] = ()
    """Base URLs of peer routers (their admin port when they have one)."""
    dns: str | None = None
    """HOST:PORT of a name listing every replica's address (a headless Service), resolved again every few
    seconds; this router's own address in it is recognised and skipped."""
    ready_grace: float = 5.0
    """How long after its start a replica answers ``/readiness`` with 503 while it is not in sync with its peers yet
    (every one answered a batch and sent one), so that it takes traffic with its first requests claimed as the others'
    are; past it, ready all the same (its peers may all be gone: it serves alone)."""
    secret: str | None = None
    """The peer secret (``--peer-secret``): every batch is signed with it and every answer too; never sent, and not
    the admin key (``coordination.auth``).  None: the channel is guarded by the peers' addresses alone."""
    queue_bytes: int = 8 * 1024 * 1024
    """What one peer's queue holds at most (the routes' text and leading chars, in bytes); past it the oldest go."""
    queue_seconds: float = 10.0
    """A route or a prefill queued for a peer longer than this is dropped, not sent: a late hint is a wrong one."""
    batch_bytes: int = 1024 * 1024
    """The largest batch a router reads (413 above it) and sends: its parse is one call the event loop waits for."""

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.dns)


PD_MODES = ("sglang", "vllm")
"""How the KV moves from prefill to decode: SGLang's bootstrap rooms, or vLLM's ``kv_transfer_params``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PDSettings:
    """Prefill/decode disaggregation."""

    enabled: bool = False
    mode: str = "sglang"
    """``sglang``: both legs at once with bootstrap fields; ``vllm``: prefill first (``max_tokens: 1``), then the
    decode with the ``kv_transfer_params`` the prefill returned (``smg_router.pd``)."""
    prefill: tuple[tuple[str, int | None], ...] = ()
    """(url, bootstrap port) of the prefill workers given on the command line."""
    decode: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class EppSettings:
    """The Endpoint Picker face (``smg_router.epp``): a gateway's Envoy asks this router where each request goes."""

    port: int = 0
    """Port of the Envoy ext_proc gRPC service on ``--host``; 0: no Endpoint Picker."""
    health_port: int = 0
    """Port of the gRPC health service alone (``liveness``, ``readiness`` and the ext_proc service name); 0: only on
    ``port``."""
    fallbacks: int = 0
    """Endpoints named after the chosen one in ``x-gateway-destination-endpoint``, least loaded first: where a gateway
    that retries goes next.  0: the chosen one alone, which is all a stock Envoy ``ORIGINAL_DST`` cluster reads."""

    @property
    def enabled(self) -> bool:
        return self.port != 0


CPU_MAX = "/sys/fs/cgroup/cpu.max"
"""cgroup v2: the container's CPU limit, ``QUOTA PERIOD`` in microseconds (``max PERIOD``: none)."""


def cpu_limit(cpu_max: str) -> int | None:
    """Cores a cgroup v2 ``cpu.max`` allows, rounded up (``150000 100000``: 2); None without a limit (``max``) or
    for a text that is no limit."""
    parts = cpu_max.split()
    if len(parts) not in (1, 2) or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1]) if len(parts) == 2 else 100_000
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, -(-quota // period))


def default_processes(path: str = CPU_MAX) -> int:
    """The container's CPU limit in whole cores (``cpu_limit``), 1 without one or outside a container."""
    try:
        with open(path) as f:
            limit = cpu_limit(f.read())
    except OSError:
        return 1
    return limit or 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessSettings:
    """Serving processes on the one data port (``pod``): the parent supervises ``count`` children."""

    count: int = 1
    """Serving processes; 1: this process serves, as it always did (no parent, no child)."""
    dir: str | None = None
    """Where the parent and its children keep their private sockets; None: a new temporary directory."""
    index: int | None = None
    """Set in a child only: its number, 0 to count - 1 (the parent is the one with count > 1 and no index)."""

    @property
    def child(self) -> bool:
        return self.index is not None

    @property
    def parent(self) -> bool:
        return self.count > 1 and self.index is None


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    process: ProcessSettings = field(default_factory=ProcessSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    load: LoadSettings = field(default_factory=LoadSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    pd: PDSettings = field(default_factory=PDSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    peers: PeerSettings = field(default_factory=PeerSettings)
    hold: HoldSettings = field(default_factory=HoldSettings)
    epp: EppSettings = field(default_factory=EppSettings)
    worker_urls: tuple[str, ...] = ()
    model_id: str | None = None
    """Model of the --worker-urls workers; None discovers it from each worker's /v1/models."""


SERVICE_LINK = re.compile(r"(tcp|udp|sctp)://\S+:[0-9]+")
"""The value Kubernetes gives ``<SERVICE>_PORT`` for every Service in the namespace (service links): a Service
named ``smg`` sets ``SMG_PORT=tcp://10.96.0.7:30000``, which is no port number.  No setting takes such a value,
so one is a collision, not a setting, and is ignored."""


def _var(name: str) -> str:
    return "SMG_" + name.upper().replace("-", "_")


def _env(name: str, default: object) -> object:
    var = _var(name)
    raw = os.environ.get(var)
    if raw is not None and SERVICE_LINK.fullmatch(raw):
        logging.getLogger(__name__).warning(
            "ignoring %s=%s: a Kubernetes service link, not a setting (set enableServiceLinks: false)", var, raw
        )
        return default
    return default if raw is None else raw


DESIGN_NUMBERS = frozenset({"--port", "--admin-port", "--process-index", "--epp-port", "--epp-health-port"})
"""The numeric flags that are no tuning knob.  Every other flag of type int or float is one: its help starts with
``tuning:`` and its default is followed by the reason for it: ``(default: VALUE; REASON)``, from
``add(..., why=...)``."""


def _shown(default: object) -> str:
    return f"{default:g}" if isinstance(default, float) else str(default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smg-router",
        description="Cache-aware router for LLM inference workers. Every flag --x-y is also read "
        "from the environment variable SMG_X_Y; a flag on the command line wins. A help that starts with "
        "'tuning:' is a number to tune, with the reason for its default.",
    )

    def add(
        group: argparse._ArgumentGroup,
        flag: str,
        default: object,
        *,
        type: Callable[[str], object] = str,
        help: str,
        why: str | None = None,
        secret: bool = False,
    ) -> None:
        """A flag whose default the environment may replace.  ``why``: a tuning knob, and the reason for its
        default; ``secret``: a token, whose value the help never shows (not even one from the environment)."""
        value = _env(flag.lstrip("-"), default)
        if why is not None:
            help = f"tuning: {help} (default: {_shown(default)}; {why})"
        elif default is not None and not secret:
            help = f"{help} (default: {_shown(default)})"
        if value is not default and not secret:
            help += f" [now %(default)s, from {_var(flag.lstrip('-'))}]"
        group.add_argument(flag, default=value, type=type, help=help)

    s, pol, ld, h, r = ServerSettings(), PolicySettings(), LoadSettings(), HealthSettings(), RetrySettings()

    serving = p.add_argument_group(
        "serving", "where the router listens, the workers it starts with, and the model names it answers to"
    )
    add(serving, "--host", s.host, help="address to listen on")
    add(serving, "--port", s.port, type=int, help="port to listen on")
    serving.add_argument(
        "--worker-urls",
        nargs="*",
        default=_split(_env("worker-urls", "")),
        help="regular workers to register at start (SMG_WORKER_URLS: comma or space separated)",
    )
    add(serving, "--model-id", None, help="model served by --worker-urls (default: ask each worker)")
    serving.add_argument(
        "--kv-events",
        action="append",
        metavar="WORKER_URL=ENDPOINT[,REPLAY_ENDPOINT]",
        default=_semis(_env("kv-events", "")),
        help="where a worker given at start publishes its KV events (tcp://HOST:PORT) and replays them; repeatable "
        "(SMG_KV_EVENTS: semicolon separated)",
    )
    serving.add_argument(
        "--model-alias",
        action="append",
        metavar="PUBLIC=SERVED",
        default=_entries(_env("model-alias", "")),
        help="a model name clients may use for a served model; repeatable (SMG_MODEL_ALIAS: comma separated)",
    )
    add(
        serving,
        "--processes",
        default_processes(),
        type=int,
        help="serving processes on --port (SO_REUSEPORT), supervised by a parent that serves --admin-port and applies "
        "every lifecycle change to each of them; each keeps its own cache-aware trees",
        why="the container's CPU limit (cgroup v2 cpu.max, rounded up), 1 without one: a process uses one core",
    )
    add(
        serving,
        "--processes-dir",
        None,
        help="with --processes above 1: the directory of the processes' private sockets (child-N.sock, one "
        "process's own view: curl --unix-socket DIR/child-0.sock http://x/metrics) (default: a new temporary one)",
    )
    serving.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the parent
    add(
        serving,
        "--api-key",
        None,
        secret=True,
        help="bearer token required by the data plane (generation endpoints, /v1/models); unset: open",
    )

    routing = p.add_argument_group("routing", "which worker a request goes to: the policy and its cache-aware tree")
    add(routing, "--policy", pol.name, help=f"routing policy: {', '.join(POLICY_NAMES)} (aliases accepted)")
    routing.add_argument(
        "--tokenizer",
        action="append",
        metavar="MODEL=PATH",
        default=_entries(_env("tokenizer", "")),
        help="a model's tokenizer (tokenizer.json, or its folder with tokenizer_config.json's chat template): its "
        "prompts are tokenized, so its workers' KV events can be matched; repeatable (SMG_TOKENIZER: comma separated)",
    )
    add(
        routing,
        "--routing-key-header",
        RoutingSettings().key_header,
        help="request header whose value pins a session to a worker (consistent hashing under the load gate; "
        "empty: off)",
    )
    add(
        routing,
        "--response-id-key",
        None,
        secret=True,
        help="key of the worker tokens the router writes into Responses ids (previous_response_id reaches the worker "
        "that stored the response through any replica); the same on every replica; unset: a fixed public key",
    )
    routing.add_argument(
        "--expose-worker-url",
        action="store_true",
        default=str(_env("expose-worker-url", "")).lower() in ("1", "true", "yes"),
        help="answers carry the routed worker's URL in x-smg-routed-worker-id, not only its opaque x-smg-worker-id "
        "(debugging: a worker's address inside the cluster is not the client's business)",
    )
    add(
        routing,
        "--cache-threshold",
        pol.cache_threshold,
        type=float,
        help="minimum prefix match rate for a hit",
        why="the SGLang router's default",
    )
    add(
        routing,
        "--balance-rel-threshold",
        pol.balance_rel_threshold,
        type=float,
        help="load gate: a worker is over it when requests already wait for a running slot there, another worker "
        "would make it wait less, and its load is more than the least load times this",
        why="the SGLang router's default; the slots are the engine's own (reported, or seen when requests wait)",
    )
    add(
        routing,
        "--placement-prefix-chars",
        pol.placement_prefix_chars,
        type=int,
        help="leading chars of a new prompt hashed to place it (the same worker on every replica)",
        why="long enough to get past a shared system prompt, short enough to be the same for every request of a "
        "prompt group",
    )
    add(
        routing,
        "--tree-chars-per-token",
        pol.tree_chars_per_token,
        type=float,
        help="a worker's tree share is capped at its engine's KV tokens times this (0: no cap)",
        why="the low side of English text's ~4 chars a token, since forgetting a prefix early costs little",
    )
    add(
        routing,
        "--prefill-hold-seconds",
        pol.prefill_hold_seconds,
        type=float,
        help="requests on a new prefix wait at most this long for the first one's prefill on their worker (0: off)",
        why="only a bound: a hold ends as soon as the first request's answer starts",
    )
    add(
        routing,
        "--tree-memory-budget",
        pol.tree_memory_budget,
        type=int,
        help="estimated bytes all cache-aware trees may hold together; past it they are LRU-evicted to 80%%",
        why="256 MiB: fits the chart's 1 GiB memory limit beside the request bodies and the runtime",
    )

    limits = p.add_argument_group(
        "limits and timeouts", "admission, upstream timeouts, retries and circuit breakers, graceful shutdown"
    )
    add(
        limits,
        "--max-payload-size",
        s.max_payload_size,
        type=int,
        help="largest request body in bytes (413 above)",
        why="8 MiB: a long prompt is a few MB of JSON",
    )
    add(
        limits,
        "--max-concurrent-requests",
        s.max_concurrent_requests,
        type=int,
        help="generation requests answered at once (503 with Retry-After above)",
        why="4 times the SGLang router's 256; not measured",
    )
    add(
        limits,
        "--max-inflight-bytes",
        s.max_inflight_bytes,
        type=int,
        help="request body bytes held at once (503 with Retry-After above)",
        why="128 MiB: about 4x that while parsed fits the chart's 1 GiB memory limit beside the trees' 256 MiB",
    )
    add(
        limits,
        "--body-timeout",
        s.body_timeout,
        type=float,
        help="seconds a request body may go without a byte arriving (a 408 past it)",
        why="nginx's client_body_timeout default",
    )
    add(
        limits,
        "--head-timeout",
        s.head_timeout,
        type=float,
        help="seconds a request head (request line and headers) may take from the connection's start or its first "
        "byte (a 408 past it); a body gets as long before --body-min-rate counts",
        why="Apache mod_reqtimeout's header timeout; a client sends its head in one write",
    )
    add(
        limits,
        "--body-min-rate",
        s.body_min_rate,
        type=int,
        help="bytes a second a request body must average once --head-timeout has passed (a 408 below; 0: no minimum)",
        why="Apache mod_reqtimeout's MinRate: 8 MiB takes 4.7 hours at it, a trickle of bytes is cut off",
    )
    add(
        limits,
        "--max-connection-buffer",
        s.max_connection_buffer,
        type=int,
        help="request body bytes one connection may have waiting for a handler, pipelined requests' included; "
        "reading from the client pauses above it",
        why="1 MiB: a read of a large body is a few wake-ups, and 1,000 connections hold a GiB at most",
    )
    add(
        limits,
        "--max-connections",
        s.max_connections,
        type=int,
        help="client connections served at once (a new one past it gets a 503 and is closed)",
        why="a fifth of a 20,000 file descriptor limit, with room for workers and peers",
    )
    add(
        limits,
        "--max-connections-per-client",
        s.max_connections_per_client,
        type=int,
        help="client connections from one address served at once (a new one past it gets a 503 and is closed)",
        why="a quarter of --max-connections: an ingress or gateway in front is one address for all its clients",
    )
    add(
        limits,
        "--max-response-header-size",
        s.max_response_header_size,
        type=int,
        help="largest head (status line and headers) of a worker's answer in bytes (a 502 above)",
        why="64 KiB: eight times the usual servers' 8 KiB header limit",
    )
    add(
        limits,
        "--max-response-size",
        s.max_response_size,
        type=int,
        help="largest body in bytes of a worker's answer that is not streamed, which the router reads whole "
        "(a 502 above)",
        why="64 MiB: a batch of embeddings of a thousand 4096-dimensional inputs is about 40 MB of JSON",
    )
    add(
        limits,
        "--request-timeout",
        s.request_timeout,
        type=float,
        help="upper bound in seconds of one upstream request, streaming included",
        why="the SGLang router's default",
    )
    add(
        limits,
        "--first-byte-timeout",
        s.first_byte_timeout,
        type=float,
        help="seconds from sending a request to a worker until its response headers; past it the attempt is "
        "retried elsewhere (or a 504)",
        why="generous: a long prompt's queueing + prefill under load takes tens of seconds, and engines send a "
        "non-streaming answer's headers only after its last token",
    )
    add(
        limits,
        "--stream-idle-timeout",
        s.stream_idle_timeout,
        type=float,
        help="longest silence in seconds between two pieces of a worker's response body, the wait for a stream's "
        "first token included; past it a stream ends with an upstream_timeout error event (a 504 if not streaming)",
        why="room for a stream's queueing + prefill, which it includes",
    )
    hold = HoldSettings()
    add(
        limits,
        "--hold-when-empty",
        hold.seconds,
        type=float,
        help="seconds a request for a known model (it has workers in any state, or was declared with PUT "
        "/models/{model}) with no routable worker waits for one (scale from zero); past it, or at once with 0, "
        "a 503 with Retry-After: 5 (smg_model_requests_waiting, smg_model_holds_total)",
        why="off: a client gets today's immediate 503 unless the deployment scales to zero and says how long a cold "
        "start takes",
    )
    add(
        limits,
        "--hold-queue-size",
        hold.queue_size,
        type=int,
        help="requests that may wait per model with --hold-when-empty (in each serving process); past it a 503 "
        "with Retry-After at once",
        why="a quarter of --max-concurrent-requests: each held request keeps its admission slot and its body, so a "
        "few models at zero cannot take them all",
    )
    add(
        limits,
        "--max-retries",
        r.max_retries,
        type=int,
        help="retries on another worker before the first byte",
        why="three attempts in all; not measured",
    )
    add(
        limits,
        "--breaker-failure-threshold",
        r.breaker_failure_threshold,
        type=int,
        help="consecutive failures that open a worker's circuit breaker",
        why="half the SGLang router's 10; not measured",
    )
    add(
        limits,
        "--breaker-cooldown",
        r.breaker_cooldown,
        type=float,
        help="seconds an open breaker waits before a half-open trial",
        why="two default --health-check-interval periods; not measured",
    )
    add(
        limits,
        "--max-ejection-share",
        r.max_ejection_share,
        type=float,
        help="largest share of a model's workers open breakers may take out of routing; past it the model's "
        "workers all serve again, open breakers or not (panic routing, smg_breaker_panics_total); 1: no bound",
        why="Envoy's outlier detection ejects at most 10%% of a cluster and panics below 50%% healthy; one of two "
        "workers may be out",
    )
    add(
        limits,
        "--retry-budget-ratio",
        r.budget_ratio,
        type=float,
        help="retries may be at most this share of the requests of the last 10 s (or --retry-budget-min); past it "
        "the failure is the answer (smg_retries_total{outcome=budget_exhausted})",
        why="Envoy's retry budget default (20%% of active requests)",
    )
    add(
        limits,
        "--retry-budget-min",
        r.budget_min,
        type=int,
        help="retries allowed in any 10 s whatever the traffic",
        why="one a second: a quiet router still retries a failure; not measured",
    )
    add(
        limits,
        "--shutdown-delay",
        s.shutdown_delay,
        type=float,
        help="after SIGTERM, seconds to keep serving with /readiness at 503 (endpoint propagation)",
        why="as long as the chart's preStop wait for the endpoints to drop the pod; not measured",
    )
    add(
        limits,
        "--shutdown-timeout",
        s.shutdown_timeout,
        type=float,
        help="then seconds for in-flight requests and streams to finish before the rest are ended",
        why="Kubernetes' default terminationGracePeriodSeconds",
    )

    pd = p.add_argument_group("prefill/decode disaggregation", "each request to a prefill and a decode worker")
    pd.add_argument(
        "--pd-disaggregation",
        action="store_true",
        default=str(_env("pd-disaggregation", "")).lower() in ("1", "true", "yes"),
        help="prefill/decode disaggregation: route each request to a prefill and a decode worker",
    )
    add(
        pd,
        "--pd-mode",
        "sglang",
        help=f"PD protocol: {' or '.join(PD_MODES)} (sglang: bootstrap rooms, both legs at once; vllm: the prefill "
        "leg first with max_tokens 1, then the decode leg with the kv_transfer_params it returned)",
    )
    pd.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar="URL [BOOTSTRAP_PORT]",
        default=[e.split() for e in _entries(_env("prefill", ""))],
        help="a prefill worker and its bootstrap port; repeat per worker (SMG_PREFILL: 'URL PORT, URL PORT')",
    )
    pd.add_argument(
        "--decode",
        nargs="+",
        action="append",
        metavar="URL",
        default=[e.split() for e in _entries(_env("decode", ""))],
        help="decode worker(s); repeat or list several (SMG_DECODE: comma separated)",
    )
    add(pd, "--prefill-policy", None, help="PD prefill policy (default: --policy)")
    add(pd, "--decode-policy", None, help="PD decode policy (default: --policy)")

    replicas = p.add_argument_group(
        "replicas", "the other replicas of this router, told every route so that every tree holds the fleet's"
    )
    replicas.add_argument(
        "--peer",
        action="append",
        metavar="URL",
        default=_entries(_env("peer", "")),
        help="another replica of this router (its admin port when it has one), told every route so that both trees "
        "hold what the fleet was sent; repeatable (SMG_PEER: comma separated)",
    )
    add(
        replicas,
        "--router-replicas",
        1,
        type=int,
        help="how many replicas of this router serve the fleet (the chart sets it); with more than one and no peers, "
        "a new prompt is placed by rendezvous rank alone, which every replica computes alike",
        why="a router started on its own is alone",
    )
    add(
        replicas,
        "--peers-dns",
        None,
        help="HOST:PORT of a name that lists every replica (a headless Service), resolved every few seconds: each "
        "address is a peer (this router's own is skipped)",
    )
    add(
        replicas,
        "--peers-ready-grace",
        PeerSettings().ready_grace,
        type=float,
        help="with peers: /readiness answers 503 until every peer answered (in sync), at most this many seconds after"
        " the start, so that a new replica takes traffic in sync with the others",
        why="one --peers-dns re-resolution interval; not measured",
    )
    add(
        replicas,
        "--prefill-claim-seconds",
        pol.prefill_claim_seconds,
        type=float,
        help="with peers: a request that leads a new prefix's prefill waits this long at most for the peers' answers"
        " (0: off)",
        why="only a bound: a claim usually waits one round trip between replicas",
    )
    add(
        replicas,
        "--prefill-claim-min-chars",
        pol.prefill_claim_min_chars,
        type=int,
        help="with peers: only a lead whose worker is to prefill at least this many chars claims it",
        why="a shorter prefill done twice costs the engine less than a claim costs the routers",
    )

    add(
        replicas,
        "--peer-secret",
        None,
        secret=True,
        help="with peers: the secret every replica signs its batches and answers with (never sent; not the admin "
        "key); unset: batches are accepted from the peers' addresses alone",
    )
    add(
        replicas,
        "--peer-queue-bytes",
        PeerSettings().queue_bytes,
        type=int,
        help="with peers: bytes of routes queued for one peer at most (the oldest are dropped past it)",
        why="a few seconds of routes at a thousand requests a second; not measured",
    )
    add(
        replicas,
        "--peer-queue-seconds",
        PeerSettings().queue_seconds,
        type=float,
        help="with peers: a route queued longer than this for a peer is dropped, not sent",
        why="a route hint older than that describes a cache that moved on; not measured",
    )
    add(
        replicas,
        "--peer-batch-bytes",
        PeerSettings().batch_bytes,
        type=int,
        help="with peers: the largest batch a replica sends and reads (413 above it)",
        why="its JSON parse is one call of ~7-35 ms per MiB that the event loop waits for",
    )

    epp = p.add_argument_group(
        "endpoint picker",
        "the Gateway API Inference Extension's Endpoint Picker: Envoy's ext_proc asks where each request goes, the "
        "gateway proxies it (docs/epp.md)",
    )
    add(
        epp,
        "--epp-port",
        0,
        type=int,
        help="port of the Envoy ext_proc gRPC service (envoy.service.ext_proc.v3.ExternalProcessor) on --host, "
        "answering each request with x-gateway-destination-endpoint (0: off)",
    )
    add(
        epp,
        "--epp-health-port",
        0,
        type=int,
        help="port of the gRPC health service (services liveness, readiness and "
        "envoy.service.ext_proc.v3.ExternalProcessor) on --host; the --epp-port answers it too (0: only there)",
    )
    add(
        epp,
        "--epp-fallbacks",
        EppSettings().fallbacks,
        type=int,
        help="endpoints named after the chosen one, least loaded first, for a gateway that retries",
        why="Envoy's ORIGINAL_DST cluster takes one ip:port from the header and fails a request naming a list "
        "(seen with Envoy 1.40); raise it for a gateway that goes down the list",
    )

    admin = p.add_argument_group("admin API", "the worker lifecycle API (POST/PUT/PATCH/DELETE /workers)")
    add(admin, "--admin-port", s.admin_port, type=int, help="port of the lifecycle mutations alone (0: --port)")
    add(
        admin,
        "--admin-api-key",
        None,
        secret=True,
        help="bearer token required by the lifecycle API (mutations); unset: open",
    )
    add(
        admin,
        "--drain-timeout",
        s.drain_timeout,
        type=float,
        help="seconds DELETE /workers waits for in-flight requests",
        why="as long as --shutdown-timeout gives in-flight requests",
    )

    observability = p.add_argument_group(
        "observability", "the router's log, and how it watches its workers (load polls, health probes)"
    )
    add(observability, "--log-level", s.log_level, help="debug, info, warning, error")
    add(
        observability,
        "--load-monitor-interval",
        ld.interval,
        type=float,
        help="seconds between worker load polls",
        why="a decision then reads a backlog at most about a second old; not measured",
    )
    add(
        observability,
        "--health-check-interval",
        h.interval,
        type=float,
        help="seconds between worker health probes",
        why="with 3 failed probes a dead worker is not_ready within about 15 s; not measured",
    )
    add(
        observability,
        "--health-failure-threshold",
        h.failure_threshold,
        type=int,
        help="failed probes before not_ready",
        why="the SGLang router's default",
    )
    return p


def _entries(raw: object) -> list[str]:
    return [e.strip() for e in str(raw).split(",") if e.strip()]


def _semis(raw: object) -> list[str]:
    return [e.strip() for e in str(raw).split(";") if e.strip()]


def _split(raw: object) -> list[str]:
    return [u for u in str(raw).replace(",", " ").split() if u]


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """Parse the command line (and environment) into Settings; exits with a message on bad input."""
    parser = build_parser()
    a = parser.parse_args(argv)
    for name in ("cache_threshold",):
        if not 0.0 <= getattr(a, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    if a.balance_rel_threshold < 1.0:
        parser.error("--balance-rel-threshold must be at least 1.0")
    if a.tree_memory_budget < 1:
        parser.error("--tree-memory-budget must be positive")
    if a.router_replicas < 1:
        parser.error("--router-replicas must be at least 1")
    if a.placement_prefix_chars < 1:
        parser.error("--placement-prefix-chars must be positive")
    if not 0.0 <= a.tree_chars_per_token < 1e6:  # NaN fails this too
        parser.error("--tree-chars-per-token must be 0 (no cap) or a positive number of chars")
    if not 0.0 <= a.prefill_hold_seconds < 1e6:  # NaN fails this too
        parser.error("--prefill-hold-seconds must be 0 (off) or a positive number of seconds")
    if not 0.0 <= a.prefill_claim_seconds <= 1.0:  # NaN fails this too
        parser.error("--prefill-claim-seconds must be 0 (off) or a number of seconds up to 1")
    if a.prefill_claim_min_chars < 0:
        parser.error("--prefill-claim-min-chars must be 0 or more")
    if a.peer_queue_bytes < 1 or a.peer_batch_bytes < 64 * 1024:
        parser.error("--peer-queue-bytes must be positive and --peer-batch-bytes at least 65536")
    if not 0.0 < a.peer_queue_seconds < 1e6:  # NaN fails this too
        parser.error("--peer-queue-seconds must be a positive number of seconds")
    if a.load_monitor_interval <= 0 or a.health_check_interval <= 0:
        parser.error("intervals must be positive")
    if a.max_payload_size < 1 or a.max_concurrent_requests < 1 or a.max_inflight_bytes < a.max_payload_size:
        parser.error(
            "--max-payload-size and --max-concurrent-requests must be positive, and "
            "--max-inflight-bytes at least --max-payload-size"
        )
    if min(a.request_timeout, a.first_byte_timeout, a.stream_idle_timeout, a.body_timeout, a.head_timeout) <= 0:
        parser.error(
            "--request-timeout, --first-byte-timeout, --stream-idle-timeout, --body-timeout and --head-timeout must "
            "be positive"
        )
    if not a.retry_budget_ratio >= 0 or a.retry_budget_min < 0:  # NaN fails the first
        parser.error("--retry-budget-ratio and --retry-budget-min must not be negative")
    if not 0.0 < a.max_ejection_share <= 1.0:
        parser.error("--max-ejection-share must be above 0 and at most 1")
    if not 0.0 <= a.hold_when_empty < 1e6:  # NaN fails this too
        parser.error("--hold-when-empty must be 0 (off) or a positive number of seconds")
    if a.hold_queue_size < 1:
        parser.error("--hold-queue-size must be positive")
    if a.body_min_rate < 0:
        parser.error("--body-min-rate must be 0 (no minimum) or a positive number of bytes a second")
    if min(a.max_connection_buffer, a.max_connections, a.max_connections_per_client) < 1:
        parser.error("--max-connection-buffer, --max-connections and --max-connections-per-client must be positive")
    if min(a.max_response_header_size, a.max_response_size) < 1:
        parser.error("--max-response-header-size and --max-response-size must be positive")
    if a.admin_port and (not 0 < a.admin_port < 65536 or a.admin_port == a.port):
        parser.error("--admin-port must be a port number other than --port (or 0)")
    for flag in ("epp_port", "epp_health_port"):
        value = getattr(a, flag)
        if not 0 <= value < 65536 or (value and value in (a.port, a.admin_port)):
            parser.error(f"--{flag.replace('_', '-')} must be a port number other than --port and --admin-port (or 0)")
    if a.epp_health_port and (not a.epp_port or a.epp_health_port == a.epp_port):
        parser.error("--epp-health-port needs --epp-port, and another port")
    if not 0 <= a.epp_fallbacks <= 16:
        parser.error("--epp-fallbacks must be from 0 to 16")
    if not 1 <= a.processes <= 256:
        parser.error("--processes must be from 1 to 256")
    if a.process_index is not None and not 0 <= a.process_index < a.processes:
        parser.error("--process-index must be below --processes")
    if a.shutdown_delay < 0 or a.shutdown_timeout < 0:
        parser.error("--shutdown-delay and --shutdown-timeout must not be negative")
    for flag in ("policy", "prefill_policy", "decode_policy"):
        value = getattr(a, flag)
        if value is not None:
            try:
                setattr(a, flag, canonical_name(value))
            except ValueError as e:
                parser.error(f"--{flag.replace('_', '-')}: {e}")
    prefill: list[tuple[str, int | None]] = []
    for entry in a.prefill:
        if len(entry) > 2:
            parser.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        port = None
        if len(entry) == 2:
            if not entry[1].isdigit() or not 0 < int(entry[1]) < 65536:
                parser.error(f"--prefill {entry[0]}: bootstrap port {entry[1]!r} is not a port number")
            port = int(entry[1])
        prefill.append((entry[0], port))
    decode = [url for entry in a.decode for url in entry]
    for url in [*_split(" ".join(a.worker_urls)), *(u for u, _ in prefill), *decode]:
        try:
            normalize_url(url)
        except SpecError as e:
            parser.error(f"worker URL {e}")
    if a.pd_mode not in PD_MODES:
        parser.error(f"--pd-mode must be one of {', '.join(PD_MODES)}, got {a.pd_mode!r}")
    if a.pd_mode != "sglang" and not a.pd_disaggregation:
        parser.error("--pd-mode needs --pd-disaggregation")
    if (prefill or decode) and not a.pd_disaggregation:
        parser.error("--prefill and --decode need --pd-disaggregation")
    if a.pd_disaggregation and a.worker_urls:
        parser.error("--worker-urls cannot be combined with --pd-disaggregation (use --prefill and --decode)")
    pairs = []
    for entry in a.model_alias:
        public, eq, served = (x.strip() for x in entry.partition("="))
        if not eq:
            parser.error(f"--model-alias takes PUBLIC=SERVED, got {entry!r}")
        pairs.append((public, served))
    try:
        aliases = resolve_aliases(pairs, a.model_id)
    except ValueError as e:
        parser.error(f"--model-alias: {e}")
    tokenizers = []
    for entry in a.tokenizer:
        model, eq, path = (x.strip() for x in entry.partition("="))
        if not eq or not model or not path:
            parser.error(f"--tokenizer takes MODEL=PATH, got {entry!r}")
        tokenizers.append((model, path))
    kv_events = []
    for entry in a.kv_events:
        url, eq, where = (x.strip() for x in entry.partition("="))
        endpoint, _, replay = (x.strip() for x in where.partition(","))
        if not eq:
            parser.error(f"--kv-events takes WORKER_URL=ENDPOINT[,REPLAY_ENDPOINT], got {entry!r}")
        try:
            spec = KvEventsSpec.from_json({"endpoint": endpoint, "replay_endpoint": replay or None})
            url = normalize_url(url)
        except SpecError as e:
            parser.error(f"--kv-events {entry!r}: {e}")
        kv_events.append((url, spec.endpoint, spec.replay_endpoint))
    peers: list[str] = []
    for url in a.peer:
        try:
            peers.append(normalize_url(url))
        except SpecError as e:
            parser.error(f"--peer {e}")
    if a.peers_dns is not None:
        host, colon, port = a.peers_dns.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--peers-dns takes HOST:PORT, got {a.peers_dns!r}")
    # a child holds its share of the pod's memory budgets (trees, request bodies): the container's limit bounds them all
    share = a.processes if a.process_index is not None else 1
    return Settings(
        process=ProcessSettings(count=a.processes, dir=a.processes_dir or None, index=a.process_index),
        peers=PeerSettings(
            urls=tuple(peers),
            dns=a.peers_dns or None,
            ready_grace=a.peers_ready_grace,
            secret=a.peer_secret or None,
            queue_bytes=a.peer_queue_bytes,
            queue_seconds=a.peer_queue_seconds,
            batch_bytes=a.peer_batch_bytes,
        ),
        routing=RoutingSettings(
            key_header=a.routing_key_header.strip().lower(),
            model_aliases=aliases,
            tokenizers=tuple(tokenizers),
            kv_events=tuple(kv_events),
            response_id_key=a.response_id_key or "",
            expose_worker_url=a.expose_worker_url,
        ),
        epp=EppSettings(port=a.epp_port, health_port=a.epp_health_port, fallbacks=a.epp_fallbacks),
        pd=PDSettings(enabled=a.pd_disaggregation, mode=a.pd_mode, prefill=tuple(prefill), decode=tuple(decode)),
        server=ServerSettings(
            host=a.host,
            port=a.port,
            admin_port=a.admin_port,
            max_payload_size=a.max_payload_size,
            max_concurrent_requests=a.max_concurrent_requests,
            max_inflight_bytes=max(a.max_payload_size, a.max_inflight_bytes // share),
            max_connection_buffer=a.max_connection_buffer,
            body_timeout=a.body_timeout,
            head_timeout=a.head_timeout,
            body_min_rate=a.body_min_rate,
            max_connections=a.max_connections,
            max_connections_per_client=a.max_connections_per_client,
            max_response_header_size=a.max_response_header_size,
            max_response_size=a.max_response_size,
            request_timeout=a.request_timeout,
            first_byte_timeout=a.first_byte_timeout,
            stream_idle_timeout=a.stream_idle_timeout,
            drain_timeout=a.drain_timeout,
            shutdown_delay=a.shutdown_delay,
            shutdown_timeout=a.shutdown_timeout,
            admin_api_key=a.admin_api_key or None,
            api_key=a.api_key or None,
            log_level=a.log_level,
        ),
        policy=PolicySettings(
            name=a.policy,
            cache_threshold=a.cache_threshold,
            balance_rel_threshold=a.balance_rel_threshold,
            tree_memory_budget=max(1, a.tree_memory_budget // share),
            placement_prefix_chars=a.placement_prefix_chars,
            index_complete=(a.router_replicas == 1 and share == 1) or bool(peers) or bool(a.peers_dns),
            tree_chars_per_token=a.tree_chars_per_token,
            prefill_hold_seconds=a.prefill_hold_seconds,
            prefill_claim_seconds=a.prefill_claim_seconds,
            prefill_claim_min_chars=a.prefill_claim_min_chars,
            prefill_policy=a.prefill_policy,
            decode_policy=a.decode_policy,
        ),
        load=LoadSettings(interval=a.load_monitor_interval),
        health=HealthSettings(interval=a.health_check_interval, failure_threshold=a.health_failure_threshold),
        retry=RetrySettings(
            max_retries=a.max_retries,
            breaker_failure_threshold=a.breaker_failure_threshold,
            breaker_cooldown=a.breaker_cooldown,
            budget_ratio=a.retry_budget_ratio,
            budget_min=a.retry_budget_min,
            max_ejection_share=a.max_ejection_share,
        ),
        hold=HoldSettings(seconds=a.hold_when_empty, queue_size=a.hold_queue_size),
        worker_urls=tuple(_split(" ".join(a.worker_urls))),
        model_id=a.model_id,
    )
