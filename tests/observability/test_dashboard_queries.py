"""Every PromQL expression of the Grafana dashboard and of the PrometheusRule, run by a real Prometheus that
scrapes real routers serving real traffic.

Set-up (all on loopback): two ``smg-sim`` workers (127.0.0.x), two ``smg-router`` processes standing for two
replicas of one router Deployment, and Debian's Prometheus scraping both every second with the labels the
chart's ServiceMonitor gives them (``job`` = the router Service name, ``namespace`` = the release namespace),
so the rendered alert rules select them as they would in a cluster.

* Replica A knows both workers and polls their load every 0.2 s: shared-prefix traffic gives tree hits and
  misses, latencies, backend loads.
* Replica B polls load only every 60 s, and its worker is registered through ``POST /workers`` *after* it
  started: its load monitor made its first (empty) round at start, so for the next 60 s it has no load figure
  for that worker and every routing decision on B counts a ``no_load_data`` fallback.  That is deterministic
  (no race with a poll, unlike an imbalance that needs overlapping requests), and it also makes the replicas
  disagree on their worker count (2 vs 1), which the SMGRouterReplicasDisagree rule must see.

The operator cannot run here (it needs a Kubernetes API), so its three metric names come from the constant
``OPERATOR_METRICS`` (the operator's fixed interface); its panels and rules are evaluated all the same and
must not error.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helm_chart import CHART, REPO, example_values, render
from support.procs import MODEL, Router, Sim, http_json, metric_value, start_router, start_sim, wait_until
from support.prometheus import (
    Prometheus,
    exported_names,
    metric_names,
    promtool_check_rules,
    start_prometheus,
)

pytestmark = pytest.mark.timeout(300)

NAMESPACE = "smg-test"
RELEASE = "smg"
ROUTER_JOB = "smg-router"  # what the chart's ServiceMonitor makes the job label: the router Service name
OPERATOR_METRICS = frozenset(
    {  # smg-operator's exported names (fixed interface); it cannot run here
        "smg_operator_hook_calls_total",
        "smg_operator_reconcile_total",
        "smg_operator_registered_workers",
    }
)
RATE_INTERVAL = "5m"  # $__rate_interval: long enough to cover all of this test's traffic
DASHBOARD = json.loads((CHART / "dashboards" / "smg.json").read_text())


# -- what is checked --------------------------------------------------------------------------------------------


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every target of every panel, rows' nested panels included."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((f"panel {panel['title']!r} {target.get('refId', '')}", target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return out


def variable_metrics(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(variable, metric) of the dashboard's ``label_values(metric, label)`` template variables."""
    out = []
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        if text.startswith("label_values("):
            inner = text[len("label_values(") :].rsplit(")", 1)[0]
            metric = inner.rsplit(",", 1)[0].strip() if "," in inner else inner.strip()
            out.append((var["name"], metric))
    return out


def substitute(expr: str) -> str:
    """Grafana's variables as Grafana would expand them for this test's data."""
    for var, value in (
        ("$__rate_interval", RATE_INTERVAL),
        ("$__interval", "15s"),
        ("$__range", "1h"),
        ("${namespace}", NAMESPACE),
        ("$namespace", NAMESPACE),
    ):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unexpanded variable in {expr}"
    return expr


def rendered_rules() -> dict[str, Any]:
    """The chart's PrometheusRule for release smg in namespace smg-test (monitoring example values)."""
    r = render(example_values("monitoring"), name=RELEASE, namespace=NAMESPACE)
    (rule,) = r.of_kind("PrometheusRule")
    return rule


RULES = rendered_rules()


def rule_queries() -> list[tuple[str, str]]:
    return [
        (f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in RULES["spec"]["groups"]
        for rule in group["rules"]
    ]


def check_expressions(prom: Prometheus, queries: list[tuple[str, str]], known: set[str]) -> list[str]:
    """Problems of each expression: Prometheus errors (instant and range query) and unknown metric names."""
    problems = []
    for where, expr in queries:
        q = substitute(expr)
        for kind, answer in (("query", prom.query(q)), ("query_range", prom.query_range(q))):
            if answer.get("status") != "success":
                problems.append(f"{where}: {kind} {answer.get('errorType')}: {answer.get('error')}: {q}")
        unknown = metric_names(q) - known
        if unknown:
            problems.append(f"{where}: metric(s) not exported: {sorted(unknown)}: {q}")
    return problems


# -- the running system -----------------------------------------------------------------------------------------


@dataclass
class Stack:
    sims: list[Sim]
    a: Router
    b: Router
    prom: Prometheus
    known: set[str]


DOCS = [("You are a meticulous assistant for the SMG router runbook. " * 12) + f"Section {i}. " for i in range(3)]


def chat(router: Router, doc: str, question: str, *, stream: bool = False) -> int:
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "stream": stream,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
    }
    status, answer = http_json("POST", router.url + "/v1/chat/completions", body, timeout=30)
    assert status == 200, answer
    return status


def complete(router: Router, doc: str, question: str) -> None:
    status, answer = http_json(
        "POST", router.url + "/v1/completions", {"model": MODEL, "prompt": doc + question, "max_tokens": 4}, timeout=30
    )
    assert status == 200, answer


def answered_requests(routers: tuple[Router, ...]) -> float:
    """Inference requests the routers have answered, from their own /metrics."""
    return sum(
        metric_value(r.metrics(), "smg_requests_total", endpoint=endpoint)
        for r in routers
        for endpoint in ("/v1/chat/completions", "/v1/completions")
    )


def scraped_requests(prom: Prometheus) -> float:
    """The same count as Prometheus last scraped it."""
    result = prom.vector(f'sum(smg_requests_total{{job="{ROUTER_JOB}", endpoint=~"/v1/(chat/)?completions"}})')
    return float(result[0]["value"][1]) if result else -1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("observability")
    started: list[Any] = []
    try:
        sims = [start_sim(tmp), start_sim(tmp)]
        started += sims
        a = start_router(tmp, workers=[s.url for s in sims])
        started.append(a)
        b = start_router(tmp, args=["--load-monitor-interval", "60"])  # the later flag wins
        started.append(b)
        status, body = b.admin("POST", "/workers", {"url": sims[0].url, "model_id": MODEL})
        assert status in (200, 201), body
        a.wait_routable(2)
        b.wait_routable(1)

        rules_file = tmp / "rules.yaml"
        rules_file.write_text(yaml.safe_dump({"groups": RULES["spec"]["groups"]}, sort_keys=False))
        scrape = [
            {
                "job_name": ROUTER_JOB,
                "metrics_path": "/metrics",
                "static_configs": [
                    {"targets": [f"{r.host}:{r.port}" for r in (a, b)], "labels": {"namespace": NAMESPACE}}
                ],
            }
        ]
        prom = start_prometheus(tmp, scrape, rule_files=[rules_file])
        started.append(prom)
        wait_until(lambda: prom.targets_up() == 2, timeout=30, what="both routers scraped")

        # Traffic spread over several scrapes, so that rate() sees the counters move: after each burst,
        # wait until Prometheus has scraped it.
        for i in range(30):
            doc = DOCS[i % len(DOCS)]
            chat(a, doc, f"Question {i}: what does step {i} do?", stream=(i % 5 == 4))
            if i % 3 == 0:
                complete(a, doc, f" Summarise part {i}.")
            if i % 2 == 0:
                chat(b, doc, f"Question {i} for replica B.")
            if i % 5 == 4:
                wait_until(
                    lambda: scraped_requests(prom) == answered_requests((a, b)),
                    timeout=30,
                    what=f"Prometheus to scrape the burst ending with request {i}",
                )
        assert metric_value(b.metrics(), "smg_routing_fallbacks_total", reason="no_load_data") > 0, b.metrics()
        assert metric_value(a.metrics(), "smg_cache_tree_hits_total") > 0, a.metrics()

        known = exported_names(a.metrics()) | exported_names(b.metrics()) | OPERATOR_METRICS
        yield Stack(sims=sims, a=a, b=b, prom=prom, known=known)
    finally:
        for thing in reversed(started):
            thing.stop()


def finite_series(prom: Prometheus, expr: str) -> list[dict[str, Any]]:
    return [s for s in prom.vector(substitute(expr)) if math.isfinite(float(s["value"][1]))]


def panel_exprs(title: str) -> list[str]:
    exprs = [expr for where, expr in dashboard_queries(DASHBOARD) if where.startswith(f"panel {title!r}")]
    assert exprs, f"no panel titled {title!r}"
    return exprs


# -- tests --------------------------------------------------------------------------------------------------------


def test_the_dashboard_covers_the_required_panels() -> None:
    titles = {where.split("'")[1] for where, _ in dashboard_queries(DASHBOARD)}
    for title in (
        "Tree hit rate by role",
        "Fallbacks by reason",
        "Prefix match ratio",
        "Request rate by endpoint",
        "Latency by endpoint",
        "Time to first token by endpoint",
        "In-flight per worker",
        "Backend load per worker",
        "Worker health",
        "Worker lifecycle events",
        "PD requests",
        "Prefill holds and claims",
        "Cache-aware decisions by branch",
        "KV events by kind",
        "KV event lag",
        "Workers routed on their KV events",
        "KV event index",
        "Reconciles by result",
        "Router call errors",
        "Engine saturation by model",
        "Demand in flight by model",
    ):
        assert title in titles, title
    quantiles = [e for _, e in dashboard_queries(DASHBOARD) if "histogram_quantile" in e]
    assert quantiles and all("_bucket{" in e and "by (le" in e for e in quantiles)


def test_repo_root_dashboard_is_the_chart_dashboard() -> None:
    assert (REPO / "dashboards" / "smg.json").read_bytes() == (CHART / "dashboards" / "smg.json").read_bytes()


def test_every_dashboard_and_rule_expression_evaluates(stack: Stack) -> None:
    queries = dashboard_queries(DASHBOARD) + rule_queries()
    assert len(queries) >= 30
    problems = check_expressions(stack.prom, queries, stack.known)
    assert not problems, "\n".join(problems)


def test_every_referenced_metric_is_exported(stack: Stack) -> None:
    referenced = set()
    for _, expr in dashboard_queries(DASHBOARD) + rule_queries():
        referenced |= metric_names(substitute(expr))
    for _, metric in variable_metrics(DASHBOARD):
        referenced |= metric_names(metric)
    assert referenced - OPERATOR_METRICS, "the extractor found no router metric at all"
    assert referenced >= OPERATOR_METRICS, "operator panels/rules use every operator metric"
    assert not referenced - stack.known, sorted(referenced - stack.known)


def test_namespace_variable_lists_the_scraped_namespace(stack: Stack) -> None:
    for _, metric in variable_metrics(DASHBOARD):
        values = stack.prom.get("/api/v1/label/namespace/values", **{"match[]": metric})["data"]
        assert NAMESPACE in values, (metric, values)


def test_hit_rate_fallback_and_request_rate_panels_have_data(stack: Stack) -> None:
    prom = stack.prom

    def hit_rate() -> list[dict[str, Any]]:
        return [s for s in finite_series(prom, panel_exprs("Tree hit rate by role")[0]) if float(s["value"][1]) > 0]

    series = wait_until(hit_rate, timeout=30, what="a positive tree hit rate in Prometheus")
    assert {s["metric"].get("role") for s in series} == {"regular"}
    assert all(0 < float(s["value"][1]) <= 1 for s in series)

    fallbacks = wait_until(
        lambda: finite_series(prom, panel_exprs("Fallbacks by reason")[0]), timeout=30, what="fallback series"
    )
    assert "no_load_data" in {s["metric"].get("reason") for s in fallbacks}

    requests = finite_series(prom, panel_exprs("Request rate by endpoint")[0])
    endpoints = {s["metric"].get("endpoint") for s in requests if float(s["value"][1]) > 0}
    assert {"/v1/chat/completions", "/v1/completions"} <= endpoints
    for title in (
        "Tree hit rate",
        "Requests / s",
        "Prefix match ratio",
        "Latency by endpoint",
        "Backend load per worker",
        "Worker health",
    ):
        assert any(finite_series(prom, e) for e in panel_exprs(title)), title


def test_alert_rules_select_the_scraped_routers(stack: Stack) -> None:
    """The rules' job/namespace selectors match what the ServiceMonitor produces, and they work on this data."""
    exprs = dict(rule_queries())
    prom = stack.prom
    disagree = wait_until(
        lambda: prom.vector(exprs["rule SMGRouterReplicasDisagree"]),
        timeout=20,
        what="replicas A (2 workers) and B (1 worker) to disagree",
    )
    assert float(disagree[0]["value"][1]) == 1
    assert prom.vector(exprs["rule SMGNoHealthyWorkers"]) == []
    ratio_expr = exprs["rule SMGHighFallbackRatio"].rsplit(">", 1)[0]
    assert finite_series(prom, ratio_expr), "fallbacks per decision has data"

    def rules_evaluated() -> list[dict[str, Any]]:
        groups = prom.get("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("health") == "ok" for r in rules) else []

    rules = wait_until(rules_evaluated, timeout=20, what="Prometheus to evaluate every rule without error")
    assert {r["name"] for r in rules} == {q.split(" ", 1)[1] for q in exprs}


def test_the_checker_catches_a_bad_query(stack: Stack) -> None:
    """A dashboard copy with a made-up metric name and a broken expression: both are reported."""
    bad = copy.deepcopy(DASHBOARD)
    targets = next(p for p in bad["panels"] if p.get("title") == "Request rate by endpoint")["targets"]
    targets[0]["expr"] = targets[0]["expr"].replace("smg_requests_total", "smg_http_requests_made_up_total")
    targets.append({"refId": "Z", "expr": 'sum(rate(smg_requests_total{namespace=~"$namespace"}[5m])'})
    made_up = substitute(targets[0]["expr"])
    answer = stack.prom.query(made_up)
    assert answer["status"] == "success" and answer["data"]["result"] == [], (
        "Prometheus does not complain about unknown names: the name check is what catches them"
    )
    problems = check_expressions(stack.prom, dashboard_queries(bad), stack.known)
    assert any("smg_http_requests_made_up_total" in p and "not exported" in p for p in problems), problems
    assert any("Request rate by endpoint' Z" in p and "bad_data" in p for p in problems), problems
    assert len(problems) == 3  # the made-up name, and the broken expression as instant and as range query


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, role) (rate(smg_prefix_match_ratio_bucket{role!="x"}[5m])))'
        " / on (role) group_left(model) (smg_a or 0 * smg_b:rate5m offset 5m) > bool 1e-9"
    )
    assert metric_names(expr) == {"smg_prefix_match_ratio_bucket", "smg_a", "smg_b:rate5m"}


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    path = tmp_path / "smg-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": RULES["spec"]["groups"]}, sort_keys=False))
    proc = promtool_check_rules(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "X", "expr": "sum(up"}]}]}))
    assert promtool_check_rules(broken).returncode != 0
