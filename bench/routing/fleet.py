"""The processes of the routing benchmark: smg-sim workers and router replicas, on loopback, stopped by PID.

Reuses ``tests/support/procs.py`` (``Proc`` logs to a file, starts its own session and is stopped by its own
PID).  Workers each get their own 127.0.0.x address, like pods; router replicas listen on 127.0.0.1.  All the
replicas of one cell are launched before any is waited for, so eight replicas start about as fast as one.
A target ``smg:...@REV`` runs smg-router of git revision REV (``target_code``: ``git archive`` into a temp dir put
first on that target's PYTHONPATH), so a before/after comparison runs in one run.  ``rust:<policy>`` is the Rust
``smg`` 1.13 and ``vllm:<policy>`` vLLM's router (``vllm-router`` 0.1.17), both from PyPI in venvs of their own.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from capacity import CostModel
from prometheus_client.parser import text_string_to_metric_families
from support.procs import Proc, Router, Sim, free_port, free_ports, http_json, next_host, sim_args
from workloads import MODEL

ROOT = Path(__file__).resolve().parents[2]
SMG_LOAD_MONITOR_S = 1.0
"""smg-router's default ``--load-monitor-interval``; scaled by ``--time-scale`` (see ``router_argv``)."""
RUST_LOAD_MONITOR_S = 10.0
"""The Rust smg's default ``--load-monitor-interval`` (its help: used by power_of_two)."""
VLLM_BIN = "/tmp/vllm-router/bin/vllm-router"
"""vLLM's router (``python3 -m venv /tmp/vllm-router && /tmp/vllm-router/bin/pip install 'vllm-router==0.1.17'``)."""


@dataclass(frozen=True, slots=True)
class Target:
    """A router under test: ``smg:<policy>`` (this repo's smg-router), ``rust:<policy>`` (``smg`` 1.13) or
    ``vllm:<policy>`` (vLLM's router, ``vllm-router`` 0.1.17); ``smg:<policy>+peers``: the replicas of a cell are each
    other's ``--peer``; ``+events`` (smg, vllm): every replica reads the workers' KV events (the sims publish them),
    smg-router tokenizing with the sim's tokenizer (vLLM's asks the worker to render the prompt); a ``~NAME`` suffix
    adds the flags of ``--variant NAME="FLAGS"`` to every replica, so arms of one comparison run side by side in one
    run; a last ``@REV`` (smg only, e.g. ``smg:cache_aware+peers~nohold@82e7b8e``) runs smg-router of git revision REV
    (``rev``, kept as written in ``name``; without it: ``--router-commit``, else the working tree)."""

    kind: str
    policy: str
    peers: bool = False
    variant: str = ""
    flags: tuple[str, ...] = ()
    rev: str = ""
    events: bool = False

    @property
    def name(self) -> str:
        return (
            f"{self.kind}:{self.policy}"
            + ("+peers" if self.peers else "")
            + ("+events" if self.events else "")
            + (f"~{self.variant}" if self.variant else "")
            + (f"@{self.rev}" if self.rev else "")
        )

    @classmethod
    def parse(cls, text: str, variants: Mapping[str, Sequence[str]] | None = None) -> Target:
        whole = text
        text, at, rev = text.partition("@")  # first: REV may hold a ~ (HEAD~1)
        text, tilde, variant = text.partition("~")
        kind, sep, policy = text.partition(":")
        policy, *modifiers = policy.split("+")
        if (
            not sep
            or kind not in ("smg", "rust", "vllm")
            or not policy
            or not set(modifiers) <= {"smg": {"peers", "events"}, "vllm": {"events"}}.get(kind, set())
            or len(set(modifiers)) != len(modifiers)
            or (at and (not rev or kind != "smg"))
        ):
            raise ValueError(
                f"target {whole!r}: expected smg:<policy>[+peers][+events][~VARIANT][@REV], rust:<policy>[~VARIANT]"
                " or vllm:<policy>[+events][~VARIANT]"
            )
        if tilde and variant not in (variants or {}):
            raise ValueError(f"target {whole}: no --variant {variant}=FLAGS")
        flags = tuple((variants or {}).get(variant, ()))
        return cls(kind, policy, "peers" in modifiers, variant, flags, rev, "events" in modifiers)


def parse_variants(specs: Sequence[str]) -> dict[str, list[str]]:
    """``--variant NAME="FLAGS"`` (repeatable) as a map of names to argument lists."""
    return {name: shlex.split(flags) for name, _, flags in (v.partition("=") for v in specs)}


def wait_for(check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``check`` until it is true; connection errors count as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, KeyError, TypeError):
            pass
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


SIM_PORT = 30000
"""The port of every simulated worker, each on its own loopback address (``sim_address``)."""


def sim_address(fleet_seed: int, i: int) -> tuple[str, int]:
    """Worker ``i``'s address: the same in every run of one fleet seed, so that its URL, its id and with them
    the rendezvous placement of every prefix are the same from run to run (with free ports, which worker a group
    hashes to changed between runs, and a cell's cached share with it, by up to 0.2).  Another seed, other
    URLs: another draw of the placement."""
    return f"127.0.{1 + fleet_seed % 250}.{10 + i}", SIM_PORT


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start_sims(
    logs: Path, *, count: int, cost: CostModel, time_scale: float, fleet_seed: int = 0, kv_events: bool = False
) -> list[Sim]:
    """``count`` smg-sim workers with the cost model's flags, each on its own loopback address
    (``sim_address``; a busy one falls back to a fresh address and says so); with ``kv_events``, each publishes its
    KV events (``kv_event_endpoints`` says where)."""
    sims: list[Sim] = []
    try:
        for i in range(count):
            host, port = sim_address(fleet_seed, i)
            if not _bindable(host, port):
                host = next_host()
                port = free_port(host)
                print(f"fleet: {sim_address(fleet_seed, i)} is taken; worker {i} on {host}:{port} instead", flush=True)
            args = sim_args(
                host,
                port,
                model=MODEL,
                time_scale=time_scale,
                extra=(
                    *("--kv-capacity", str(cost.kv_capacity), "--max-running", str(cost.max_running)),
                    *("--prefill-tps", str(cost.prefill_tps), "--decode-step-ms", str(cost.decode_step_ms)),
                    *("--decode-step-ms-per-req", str(cost.decode_step_ms_per_req), "--log-level", "warning"),
                    *("--cache-on", cost.cache_on),
                    *(
                        ("--kv-events-endpoint", f"tcp://{host}:*", "--kv-events-replay-endpoint", f"tcp://{host}:*")
                        if kv_events
                        else ()
                    ),
                ),
            )
            name = f"sim-{host}-{port}"
            sim = Sim(name=name, args=args, log_path=logs / f"{name}.log", host=host, port=port)
            sim.start()
            sims.append(sim)
        for sim in sims:
            wait_for(partial(_healthy, sim), timeout=30, what=sim.url)
    except BaseException:
        stop_all(sims)
        raise
    return sims


def kv_event_endpoints(sims: Sequence[Sim]) -> dict[str, tuple[str, str]]:
    """Worker url -> (KV events endpoint, replay endpoint) of the sims that publish them (their ``/server_info``)."""
    found = {}
    for sim in sims:
        info = http_json("GET", sim.url + "/server_info", timeout=5)[1].get("kv_events")
        if info:
            found[sim.url] = (info["endpoint"], info["replay_endpoint"])
    return found


def _healthy(sim: Sim) -> bool:
    return sim.alive() and http_json("GET", sim.url + "/health", timeout=1)[0] == 200


def resolve_commit(rev: str) -> str:
    """The full hash of git revision ``rev`` of this repository (ValueError if there is none)."""
    done = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise ValueError(f"no commit {rev!r} in {ROOT}")
    return done.stdout.strip()


def router_code(commit: str | None, workdir: Path) -> Path | None:
    """The directory to put first on PYTHONPATH to run smg-router of ``commit`` (None: the installed tree); one
    directory per commit under ``workdir``, extracted once."""
    if commit is None:
        return None
    sha = resolve_commit(commit)
    target = workdir / f"router-{sha[:12]}"
    if not target.exists():
        target.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha, "router"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "router"


@dataclass(frozen=True, slots=True)
class TargetCode:
    """The smg-router a target runs: ``commit`` (full hash; None: the working tree) and the directory to put first
    on PYTHONPATH (None: the installed tree)."""

    commit: str | None
    pythonpath: Path | None


def target_code(targets: Sequence[Target], default_rev: str | None, workdir: Path) -> dict[Target, TargetCode]:
    """Per smg target, the router code it runs: its own ``@REV``, else ``default_rev`` (``--router-commit``), else
    the working tree.  Targets of one commit share one extracted directory."""
    out: dict[Target, TargetCode] = {}
    for t in targets:
        if t.kind != "smg":
            continue
        rev = t.rev or default_rev
        out[t] = TargetCode(resolve_commit(rev), router_code(rev, workdir)) if rev else TargetCode(None, None)
    return out


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start the replicas of one target."""

    target: Target
    workers: Sequence[str]
    time_scale: float
    smg_args: Sequence[str] = ()
    rust_args: Sequence[str] = ()
    rust_bin: str = "/tmp/smg-rust/bin/smg"
    vllm_args: Sequence[str] = ()
    vllm_bin: str = VLLM_BIN
    router_pythonpath: Path | None = None
    kv_events: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Worker url -> where its KV events are (for a ``+events`` target)."""

    def argv(self, port: int, peers: Sequence[int] = ()) -> list[str]:
        """The command line of one replica (``peers``: the ports of the others, for a ``+peers`` target).  The
        load poll interval keeps its ratio to simulated time."""
        t = self.target
        if t.kind == "smg":
            return [
                *(sys.executable, "-m", "smg_router", "--host", "127.0.0.1", "--port", str(port)),
                *("--policy", t.policy, "--log-level", "warning", "--shutdown-delay", "0"),
                *("--load-monitor-interval", f"{max(0.05, SMG_LOAD_MONITOR_S * self.time_scale):g}"),
                *("--worker-urls", *self.workers),
                *(a for p in (peers if t.peers else ()) for a in ("--peer", f"http://127.0.0.1:{p}")),
                *(self._events_args() if t.events else ()),
                *self.smg_args,
                *t.flags,
            ]
        if t.kind == "vllm":
            return [
                *(self.vllm_bin, "--host", "127.0.0.1", "--port", str(port), "--policy", t.policy),
                # its metrics server: loopback (its default too) and a port of its own (29000 by default)
                *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1"))),
                *("--log-level", "warning", "--worker-urls", *self.workers),
                *(self._vllm_events_args() if t.events else ()),
                *self.vllm_args,
                *t.flags,
            ]
        return [
            *(self.rust_bin, "launch", "--host", "127.0.0.1", "--port", str(port)),
            *("--policy", t.policy, "--log-level", "warn"),
            # its metrics server binds 0.0.0.0:29000 by default: one per replica, on loopback
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1"))),
            *("--load-monitor-interval", str(max(1, round(RUST_LOAD_MONITOR_S * self.time_scale)))),
            *("--worker-urls", *self.workers),
            *self.rust_args,
            *t.flags,
        ]

    def _events_args(self) -> list[str]:
        from smg_sim.tokenizer_files import TOKENIZER_DIR

        args = ["--tokenizer", f"{MODEL}={TOKENIZER_DIR}"]
        for url, (endpoint, replay) in self.kv_events.items():
            args += ["--kv-events", f"{url}={endpoint},{replay}"]
        return args

    def _vllm_events_args(self) -> list[str]:
        """vLLM's router reads each worker's events from static sources (its ``kv_aware`` policy); it tokenizes by
        asking the worker to render the prompt (``/v1/completions/render``, ``/v1/chat/completions/render``)."""
        args = ["--kv-event-model", MODEL]
        for url, (endpoint, replay) in self.kv_events.items():
            args += ["--kv-event-source", f"{url}={endpoint}", "--kv-event-replay-source", f"{url}={replay}"]
        return args

    def env(self) -> dict[str, str]:
        if self.target.kind == "smg" and self.router_pythonpath is not None:
            paths = [str(self.router_pythonpath), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            return {"PYTHONPATH": os.pathsep.join(paths)}
        return {}

    def ready_or_dead(self, router: Router) -> bool:
        """Every worker is routable on this replica, and it is ready (an smg-router with peers: in sync with them),
        or it exited: no use waiting."""
        if not router.alive():
            return True
        if self.target.kind == "smg":
            status, body = http_json("GET", router.url + "/workers", timeout=1)
            routable = status == 200 and sum(bool(w["routable"]) for w in body["workers"]) == len(self.workers)
            return routable and http_json("GET", router.url + "/readiness", timeout=1)[0] == 200
        # the Rust smg and vLLM's router answer /readiness alike
        status, body = http_json("GET", router.url + "/readiness", timeout=1)
        return status == 200 and body.get("healthy_workers") == len(self.workers)


def start_replicas(logs: Path, launch: Launch, *, count: int, tag: str) -> list[Router]:
    """``count`` replicas of ``launch.target``, each in front of every worker, all ready."""
    routers: list[Router] = []
    ports = free_ports(count)
    try:
        for i, port in enumerate(ports):
            name = re.sub(r"[^\w.~-]", "-", f"{tag}-r{i}-{port}")  # a log file's name (REV may hold a /)
            others = [p for p in ports if p != port]
            env = {**launch.env(), "SMG_ROUTER_REPLICAS": str(count)}  # as the chart tells its replicas
            router = Router(
                name=name, args=launch.argv(port, others), log_path=logs / f"{name}.log", env=env, port=port
            )
            router.start()
            routers.append(router)
        for r in routers:
            wait_for(partial(launch.ready_or_dead, r), timeout=60, what=f"{launch.target.name} {r.url}")
            if not r.alive():
                raise RuntimeError(f"{launch.target.name} replica exited:\n{r.log()[-2000:]}")
    except BaseException:
        stop_all(routers, kill=True)
        raise
    return routers


def stop_all(procs: Sequence[Proc], *, kill: bool = False) -> None:
    """Stop every process by its own PID (SIGKILL for routers: they hold nothing worth a graceful exit)."""
    for p in procs:
        try:
            p.kill() if kill else p.stop()
        except Exception as e:
            print(f"warning: could not stop {p.name}: {e}", file=sys.stderr)


DECISION_SERIES = (
    "smg_routing_decisions_total",
    "smg_routing_fallbacks_total",
    "smg_prefill_holds_total",
    "smg_prefill_claims_total",
)
"""The router's own account of its choices, summed over a cell's replicas (smg targets only)."""


def decision_counts(routers: Sequence[Router]) -> dict[str, dict[str, float]]:
    """Per series of ``DECISION_SERIES``: branch (decisions), reason (fallbacks) or outcome -> count over every replica,
    scraped from each replica's ``/metrics`` before it stops (what the router says it did, beside what the
    workers say they cached)."""
    totals: dict[str, Counter[str]] = {name: Counter() for name in DECISION_SERIES}
    for r in routers:
        with urllib.request.urlopen(r.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    labels = sample.labels
                    key = labels.get("branch") or labels.get("reason") or labels.get("outcome") or "?"
                    totals[sample.name][key] += sample.value
    return {name: dict(sorted(c.items())) for name, c in totals.items()}
