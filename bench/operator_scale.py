"""Operator at scale on the real API server: many SMGWorkers, many worker pods, pods churning.

Usage:  python bench/operator_scale.py [--smgworkers 50] [--pods-per-smgworker 20] [--replicas 2] [--churn 0.10]
                                      [--duration 180] [--quiet 60] [--quick] [--operator-commit REV] [--json]

etcd + kube-apiserver 1.20 on loopback (``tests/support/kube.py``) with its audit log on (``ControlPlane(audit=True)``);
a real ``smg-operator`` logged in as its own service account (bound to cluster-admin: RBAC is not what is measured,
and the audit log tells its requests from ours by that user); ``--replicas`` real ``smg-router`` processes as the
router Service's pods (router defaults: health checks every 5 s); the worker pods are API objects only
(``tests/support/scale_fleet.py`` says why that is honest).

Phases: *fill* (every pod created Ready, until each is on every replica), *quiet* (``--quiet`` seconds with no pod
event: the timer's own load, the baseline of the ratios), *churn* (``--churn`` of the pods replaced per minute for
``--duration`` seconds: delete a Ready pod, which stays terminating for ``--grace`` s, create its replacement with a
new name, UID and IP, Running, and make it Ready ``--ready-delay`` s later), then *settle* (until every replica holds
exactly the live Ready pods).

Reported per phase: pod Ready -> registered on every replica and pod deleted -> gone from every replica (p50, p99,
max: from the routers' own ``worker added/removed`` log stamps, ``tests/support/scale_figures.py``), the operator's
API requests per minute (the audit log, by verb and resource), its router calls per minute
(``smg_operator_hook_calls_total``; ``list`` is ``GET /workers``), reconcile passes per minute, and the CPU seconds
per minute of the operator and of the routers together.  ``--operator-commit REV`` runs the operator of that commit
(``git archive``, on ``PYTHONPATH``) instead of the working tree, so a "before" figure does not pick up edits in
progress.  Run from the repository root with the project's venv; absolute figures vary between machines, compare
runs made side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.kube import ControlPlane, wait_for  # noqa: E402
from support.operator_env import KEY, Env, new_env  # noqa: E402
from support.operator_proc import OperatorProcess  # noqa: E402
from support.scale_figures import (  # noqa: E402
    HOOKS,
    Latencies,
    Snapshot,
    audit_requests,
    latencies,
    percentile,
    router_log_times,
)
from support.scale_fleet import ScaleFleet, Scenario  # noqa: E402

ROUTER_ARGS = ["--health-check-interval", "5", "--load-monitor-interval", "1"]
"""The router's own defaults (the test helper's faster probes would have 1000 unanswered probes every 0.3 s)."""
SA = "smg-operator"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smgworkers", type=int, default=50)
    p.add_argument("--pods-per-smgworker", type=int, default=20)
    p.add_argument("--replicas", type=int, default=2, help="router replicas")
    p.add_argument("--churn", type=float, default=0.10, help="fraction of the pods replaced per minute")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of churn")
    p.add_argument("--quiet", type=float, default=60.0, help="seconds without pod events before the churn")
    p.add_argument("--quick", action="store_true", help="60 s of churn after 20 quiet seconds")
    p.add_argument("--ready-delay", type=float, default=1.0)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--settle", type=float, default=180.0, help="longest wait for the replicas to converge")
    p.add_argument("--reconcile-interval", type=float, default=None, help="operator flag (default: its own, 10 s)")
    p.add_argument("--operator-commit", default=None, help="run the operator of this commit (git archive)")
    p.add_argument("--keep", type=Path, default=None, help="keep the logs here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.quiet = 60.0, 20.0
    return a


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def operator_code(commit: str | None, workdir: Path) -> tuple[dict[str, Any], Path | None]:
    """Which operator code runs, and the directory to put on PYTHONPATH for it (None: the working tree)."""
    if commit is None:
        dirty = bool(git("status", "--porcelain", "--", "operator/"))
        return {"source": "working tree", "head": git("rev-parse", "HEAD"), "operator_uncommitted": dirty}, None
    sha = git("rev-parse", commit)
    target = workdir / f"operator-{sha[:12]}"
    target.mkdir()
    archive = subprocess.run(["git", "archive", sha, "operator"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return {"source": f"git archive {sha}", "head": git("rev-parse", "HEAD"), "commit": sha}, target / "operator"


def operator_login(cp: ControlPlane, ns: str, workdir: Path) -> tuple[Path, str]:
    """A kubeconfig for service account ``ns/smg-operator`` bound to cluster-admin, and its user name."""
    token = cp.service_account_token(ns, SA, expiration_seconds=4 * 3600)
    cp.api(
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{ns}-{SA}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": ns}],
        },
    )
    kubeconfig = cp.kubeconfig_for_token(token, workdir / "operator.kubeconfig", namespace=ns)
    return kubeconfig, f"system:serviceaccount:{ns}:{SA}"


@dataclass
class Phase:
    name: str
    start: float
    end: float
    before: Snapshot
    after: Snapshot
    latencies: Latencies
    requests: Counter[str]

    @property
    def minutes(self) -> float:
        return max(self.end - self.start, 1e-9) / 60.0

    def per_minute(self, value: float) -> float:
        return value / self.minutes

    def row(self) -> dict[str, Any]:
        lat = self.latencies
        hooks = {h: self.per_minute(self.after.hook_calls[h] - self.before.hook_calls[h]) for h in HOOKS}
        return {
            "seconds": self.end - self.start,
            "pods_ready": len(lat.ready_to_registered) + len(lat.not_registered),
            "ready_to_registered_s": _spread(lat.ready_to_registered),
            "not_registered": lat.not_registered[:20],
            "pods_deleted": len(lat.deleted_to_gone) + len(lat.not_removed),
            "deleted_to_gone_s": _spread(lat.deleted_to_gone),
            "not_removed": lat.not_removed[:20],
            "api_requests_per_min": self.per_minute(sum(self.requests.values())),
            "api_requests_by_kind_per_min": {k: self.per_minute(v) for k, v in self.requests.most_common()},
            "router_calls_per_min": hooks,
            "reconciles_per_min": self.per_minute(self.after.reconciles - self.before.reconciles),
            "operator_cpu_s_per_min": self.per_minute(self.after.operator_cpu - self.before.operator_cpu),
            "routers_cpu_s_per_min": self.per_minute(self.after.routers_cpu - self.before.routers_cpu),
        }


def _spread(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "max": max(values, default=None)}


class Run:
    """The processes of one run and the snapshots taken between its phases."""

    def __init__(self, cp: ControlPlane, env: Env, op: OperatorProcess, fleet: ScaleFleet, user: str):
        self.cp, self.env, self.op, self.fleet, self.user = cp, env, op, fleet, user

    def snapshot(self) -> Snapshot:
        assert self.op.proc.popen is not None
        pids = [r.popen.pid for r in self.env.routers.values() if r.popen is not None]
        return Snapshot.take(
            at=time.time(), metrics=self.op.metrics(), operator_pid=self.op.proc.popen.pid, router_pids=pids
        )

    def converge(self, timeout: float) -> float:
        t0 = time.monotonic()
        wait_for(self.fleet.converged, timeout=timeout, interval=0.5, what="every replica to hold the live Ready pods")
        return time.monotonic() - t0

    def phase(self, name: str, before: Snapshot, after: Snapshot) -> Phase:
        routers = {pod: router_log_times(r.log()) for pod, r in self.env.routers.items()}
        lat = latencies(self.fleet.pods.values(), routers, start=before.at, end=after.at)
        reqs = audit_requests(self.cp.audit_events(), user=self.user, start=before.at, end=after.at)
        return Phase(name, before.at, after.at, before, after, lat, reqs)


def run(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    scenario = Scenario(
        smgworkers=a.smgworkers,
        pods_per_smgworker=a.pods_per_smgworker,
        churn_per_minute=a.churn,
        ready_delay=a.ready_delay,
        grace=a.grace,
    )
    code, pythonpath = operator_code(a.operator_commit, workdir)
    logs = workdir / "logs"
    logs.mkdir()
    with ControlPlane(workdir / "kube", log_dir=logs, audit=True) as cp:
        env = new_env(cp, logs, f"scale-{uuid.uuid4().hex[:6]}", replicas=a.replicas)
        env.add_service("smg-router", "smg-router")
        for i in range(a.replicas):
            env.add_router_pod(f"router-{i}", args=ROUTER_ARGS)
        kubeconfig, user = operator_login(cp, env.ns, workdir)
        args = ["--namespace", env.ns, "--router-service", "smg-router", "--router-namespace", env.ns]
        args += ["--router-port", str(env.router_port)]
        if a.reconcile_interval:
            args += ["--reconcile-interval", str(a.reconcile_interval)]
        op = OperatorProcess(logs, kubeconfig, admin_key=KEY, args=args)
        if pythonpath is not None:
            op.proc.env["PYTHONPATH"] = str(pythonpath)
        op.start(timeout=60)
        fleet = ScaleFleet(env, scenario)
        r = Run(cp, env, op, fleet, user)
        try:
            fleet.create_smgworkers()
            s0 = r.snapshot()
            fleet.fill()
            fill_settle = r.converge(a.settle)
            s1 = r.snapshot()
            time.sleep(a.quiet)  # a measurement window with no pod event, not a wait for something to happen
            s2 = r.snapshot()
            fleet.churn(a.duration)
            s3 = r.snapshot()
            churn_settle = r.converge(a.settle)
            phases = [r.phase("fill", s0, s1), r.phase("quiet", s1, s2), r.phase("churn", s2, s3)]
        finally:
            op.stop()
            for router in env.routers.values():
                router.stop()
    return {
        "scenario": {**asdict(scenario), "pods": scenario.pods, "replicas": a.replicas, "duration": a.duration},
        "operator": code,
        "replacements": fleet.churned,
        "fill_converged_after_s": fill_settle,
        "churn_settled_after_s": churn_settle,
        "phases": {p.name: p.row() for p in phases},
        "logs": str(logs),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.1f}x" if den else "-"


def print_table(result: dict[str, Any]) -> None:
    s, ph = result["scenario"], result["phases"]
    names = list(ph)
    print(
        f"operator scale: {s['smgworkers']} SMGWorkers x {s['pods_per_smgworker']} pods = {s['pods']}, "
        f"{s['replicas']} router replicas, churn {s['churn_per_minute']:.0%}/min for {s['duration']:.0f} s "
        f"({result['replacements']} replacements)"
    )
    code = result["operator"]
    dirty = " (operator/ has uncommitted changes)" if code.get("operator_uncommitted") else ""
    print(f"operator code: {code['source']}{dirty}; HEAD {code['head'][:12]}")
    print(
        f"fill converged {result['fill_converged_after_s']:.1f} s after the last pod was Ready; "
        f"churn settled {result['churn_settled_after_s']:.1f} s after it ended"
    )

    def line(label: str, cells: list[str]) -> None:
        print(f"{label:50} " + " ".join(f"{c:>18}" for c in cells))

    line("figure", names)
    line("seconds", [f"{ph[n]['seconds']:.0f}" for n in names])
    for kind, count, unit in (
        ("ready_to_registered_s", "pods_ready", "Ready -> on every replica"),
        ("deleted_to_gone_s", "pods_deleted", "deleted -> gone from every replica"),
    ):
        line(f"pods ({unit.split(' ')[0]})", [str(ph[n][count]) for n in names])
        line(
            f"{unit} p50/p99/max ms",
            ["/".join(_ms(ph[n][kind][q]) for q in ("p50", "p99", "max")) for n in names],
        )
    line(
        "never registered / never removed",
        [f"{len(ph[n]['not_registered'])}/{len(ph[n]['not_removed'])}" for n in names],
    )
    line("operator API requests /min", [f"{ph[n]['api_requests_per_min']:.0f}" for n in names])
    kinds = sorted({k for n in names for k in ph[n]["api_requests_by_kind_per_min"]})
    for k in kinds:
        line(f"  {k}", [f"{ph[n]['api_requests_by_kind_per_min'].get(k, 0):.1f}" for n in names])
    for hook in HOOKS:
        label = "GET /workers (list) /min" if hook == "list" else f"router {hook} calls /min"
        line(label, [f"{ph[n]['router_calls_per_min'][hook]:.0f}" for n in names])
    line("reconcile passes /min", [f"{ph[n]['reconciles_per_min']:.0f}" for n in names])
    line("operator CPU s/min", [f"{ph[n]['operator_cpu_s_per_min']:.2f}" for n in names])
    line("routers CPU s/min (all replicas)", [f"{ph[n]['routers_cpu_s_per_min']:.2f}" for n in names])
    quiet, churn = ph.get("quiet"), ph.get("churn")
    if quiet and churn:
        replaced_per_min = result["replacements"] / (churn["seconds"] / 60.0) or float("nan")
        extra_api = churn["api_requests_per_min"] - quiet["api_requests_per_min"]
        extra_list = churn["router_calls_per_min"]["list"] - quiet["router_calls_per_min"]["list"]
        print(
            # no API-request ratio: the quiet phase's few status refreshes (one per SMGWorker per 60 s) land in a
            # short window or not, depending on when each SMGWorker last wrote
            "ratios churn/quiet: "
            f"GET /workers {_ratio(churn['router_calls_per_min']['list'], quiet['router_calls_per_min']['list'])}, "
            f"reconcile passes {_ratio(churn['reconciles_per_min'], quiet['reconciles_per_min'])}, "
            f"operator CPU {_ratio(churn['operator_cpu_s_per_min'], quiet['operator_cpu_s_per_min'])}"
        )
        print(
            f"per replaced pod (churn minus quiet, {replaced_per_min:.0f} replacements/min): "
            f"{extra_api / replaced_per_min:.1f} API requests, {extra_list / replaced_per_min:.1f} GET /workers"
        )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
        result = run(a, Path(tempfile.mkdtemp(prefix="scale-", dir=a.keep)))
    else:
        with tempfile.TemporaryDirectory(prefix="smg-scale-") as tmp:
            result = run(a, Path(tmp))
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
