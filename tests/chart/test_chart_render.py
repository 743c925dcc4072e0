"""What the chart renders: the objects for each configuration, their wiring, and their validity.

Built-in kinds are checked with ``kubernetes-validate --strict`` (unknown fields rejected) for an old and a
recent Kubernetes; rendered YAML passes ``yamllint`` (relaxed); the chart's CRD is the repo's byte for byte.
"""

from __future__ import annotations

import base64
import json

import kubernetes_validate
import pytest
import yaml
from support.helm_chart import CHART, EXAMPLES, REPO, Rendered, example_values, render
from yamllint import linter
from yamllint.config import YamlLintConfig

# Not built-in kinds: each is checked against its own schema elsewhere (ScaledObject: test_chart_keda.py)
CUSTOM_KINDS = {"SMGWorker", "ServiceMonitor", "PrometheusRule", "InferencePool", "HTTPRoute", "ScaledObject"}
KUBE_VERSIONS = ["1.25", "1.30", "1.36"]

CONFIGS = {
    "defaults": {},
    **{path.stem: example_values(path.stem) for path in EXAMPLES},
    "sim-pd": {"router": {"pd": {"enabled": True}}, "sim": {"enabled": True, "pd": {"enabled": True}}},
    "cluster-wide-ha": {"operator": {"clusterWide": True, "replicas": 2}, "auth": {"existingSecret": "mine"}},
    "network-policy": {
        "networkPolicy": {
            "enabled": True,
            "adminNamespaces": ["platform"],
            "adminFrom": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}],
        },
        "operator": {"replicas": 2, "allowedRouterServices": ["team-a/router"], "allowedEndpoints": ["10.0.0.0/8"]},
    },
    "shared-port": {"router": {"adminPort": 0}, "networkPolicy": {"enabled": False}},
    "everything": {
        **example_values("monitoring"),
        "sim": {"enabled": True},
        "operator": {"replicas": 2},
        "router": {"workerUrls": ["http://10.0.0.5:8000"], "modelId": "m"},
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return {name: render(values) for name, values in CONFIGS.items()}


def env_of(deployment: dict) -> dict[str, dict]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in container.get("env", [])}


def args_of(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0].get("args", [])


# -- which objects -------------------------------------------------------------------------------------------


def test_defaults_render_the_core_objects(rendered: dict[str, Rendered]) -> None:
    r = rendered["defaults"]
    crd = r.get("CustomResourceDefinition", "smgworkers.smg.dev")
    assert crd["spec"]["group"] == "smg.dev"
    r.get("Deployment", "smg-router")
    r.get("Deployment", "smg-operator")
    r.get("Service", "smg-router")
    r.get("Service", "smg-router-admin")
    r.get("Service", "smg-operator-metrics")
    r.get("ServiceAccount", "smg-router")
    r.get("ServiceAccount", "smg-operator")
    r.get("Role", "smg-operator", "smg")
    r.get("RoleBinding", "smg-operator", "smg")
    r.get("ClusterRole", "smg-operator-discovery-smg")
    r.get("ClusterRoleBinding", "smg-operator-discovery-smg")
    r.get("Secret", "smg-admin")
    r.get("PodDisruptionBudget", "smg-router")
    for absent in ("ServiceMonitor", "PrometheusRule", "SMGWorker", "ConfigMap"):
        assert not r.of_kind(absent), f"{absent} rendered by default"
    r.get("NetworkPolicy", "smg-router")  # the admin port fenced off
    r.get("NetworkPolicy", "smg-operator")
    r.get("Secret", "smg-peers")  # the replicas' --peer-secret
    r.get("Secret", "smg-checksum-salt")
    assert len(r.of_kind("Deployment")) == 2


def test_monitoring_renders_servicemonitors_rules_and_dashboard(rendered: dict[str, Rendered]) -> None:
    r = rendered["monitoring"]
    router_sm = r.get("ServiceMonitor", "smg-router")
    assert router_sm["spec"]["endpoints"][0]["port"] == "http"
    assert router_sm["spec"]["selector"]["matchLabels"] == r.get("Service", "smg-router")["spec"]["selector"]
    assert router_sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    operator_sm = r.get("ServiceMonitor", "smg-operator")
    assert operator_sm["spec"]["endpoints"][0]["port"] == "metrics"
    rule = r.get("PrometheusRule", "smg")
    alerts = {rule["alert"] for group in rule["spec"]["groups"] for rule in group["rules"]}
    assert alerts == {
        "SMGNoHealthyWorkers",
        "SMGHighFallbackRatio",
        "SMGRouterReplicasDisagree",
        "SMGOperatorReconcileErrors",
        "SMGOperatorRouterCallsFailing",
    }
    no_healthy = next(
        rule for g in rule["spec"]["groups"] for rule in g["rules"] if rule["alert"] == "SMGNoHealthyWorkers"
    )
    assert no_healthy["expr"].startswith("sum(smg_worker_healthy{") and no_healthy["expr"].endswith("== 0")
    dashboard = r.get("ConfigMap", "smg-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["smg.json"] == (CHART / "dashboards" / "smg.json").read_text().rstrip("\n")
    assert json.loads(dashboard["data"]["smg.json"])["uid"] == "smg-router"


def test_dashboard_copy_at_repo_root_is_identical() -> None:
    """The chart's dashboards/smg.json is canonical (read with .Files.Get); dashboards/smg.json is a copy."""
    assert (REPO / "dashboards" / "smg.json").read_bytes() == (CHART / "dashboards" / "smg.json").read_bytes()


def test_chart_crd_is_the_repo_crd_byte_for_byte() -> None:
    assert (CHART / "crds" / "smgworker.yaml").read_bytes() == (REPO / "crds" / "smgworker.yaml").read_bytes()


def test_sim_fleet_renders_deployments_and_smgworkers(rendered: dict[str, Rendered]) -> None:
    r = rendered["sim"]
    sim = r.get("Deployment", "smg-sim-regular")
    container = sim["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["smg-sim"]
    args = container["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--model") + 1] == "sim-model"
    assert sim["spec"]["replicas"] == 3
    worker = r.get("SMGWorker", "smg-sim-regular")
    assert worker["spec"]["role"] == "regular"
    assert worker["spec"]["selector"]["matchLabels"] == sim["spec"]["selector"]["matchLabels"]
    # the router's admin port: the operator registers the workers there
    assert worker["spec"]["router"] == {"service": "smg-router", "namespace": "smg", "port": 30001}

    pd = rendered["sim-pd"]
    prefill, decode = pd.get("Deployment", "smg-sim-prefill"), pd.get("Deployment", "smg-sim-decode")
    assert not [d for d in pd.of_kind("Deployment") if d["metadata"]["name"] == "smg-sim-regular"]
    assert "--bootstrap-port" in args_of(prefill) and "--bootstrap-port" not in args_of(decode)
    assert args_of(prefill)[args_of(prefill).index("--role") + 1] == "prefill"
    assert pd.get("SMGWorker", "smg-sim-prefill")["spec"]["bootstrapPort"] == 8998
    assert pd.get("SMGWorker", "smg-sim-decode")["spec"]["role"] == "decode"
    assert env_of(pd.get("Deployment", "smg-router"))["SMG_PD_DISAGGREGATION"]["value"] == "true"


def test_smgworkers_from_values_default_to_this_router(rendered: dict[str, Rendered]) -> None:
    r = rendered["pd"]
    prefill = r.get("SMGWorker", "deepseek-prefill")
    assert prefill["spec"]["router"] == {"service": "smg-router", "namespace": "smg", "port": 30001}
    assert prefill["spec"]["bootstrapPort"] == 8998
    assert r.get("SMGWorker", "deepseek-decode")["spec"]["role"] == "decode"


# -- wiring ----------------------------------------------------------------------------------------------------


def test_router_deployment_wiring(rendered: dict[str, Rendered]) -> None:
    r = rendered["regular"]
    router = r.get("Deployment", "smg-router")
    assert router["spec"]["replicas"] == 3
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["smg-router"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert container["ports"][0]["containerPort"] == 30000
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "512Mi"}
    env = env_of(router)
    expected = {
        "SMG_HOST": "0.0.0.0",
        "SMG_PORT": "30000",
        "SMG_POLICY": "cache_aware",
        "SMG_CACHE_THRESHOLD": "0.3",
        "SMG_BALANCE_REL_THRESHOLD": "1.5",
        "SMG_TREE_MEMORY_BUDGET": "268435456",
        "SMG_LOAD_MONITOR_INTERVAL": "1",
        "SMG_MAX_PAYLOAD_SIZE": "8388608",
        "SMG_MAX_CONCURRENT_REQUESTS": "1024",
        "SMG_MAX_INFLIGHT_BYTES": "134217728",
    }
    assert {k: env[k]["value"] for k in expected} == expected
    assert "SMG_PD_DISAGGREGATION" not in env
    service = r.get("Service", "smg-router")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    pdb = r.get("PodDisruptionBudget", "smg-router")
    assert pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]


def test_router_pd_values_become_env(rendered: dict[str, Rendered]) -> None:
    env = env_of(rendered["pd"].get("Deployment", "smg-router"))
    assert env["SMG_PD_DISAGGREGATION"]["value"] == "true"
    assert env["SMG_PREFILL_POLICY"]["value"] == "cache_aware"
    assert env["SMG_DECODE_POLICY"]["value"] == "power_of_two"
    static = render(
        {
            "router": {
                "pd": {
                    "enabled": True,
                    "prefill": [
                        {"url": "http://10.0.0.1:8000", "bootstrapPort": 8998},
                        {"url": "http://10.0.0.2:8000"},
                    ],
                    "decode": ["http://10.0.0.3:8000", "http://10.0.0.4:8000"],
                }
            }
        }
    )
    env = env_of(static.get("Deployment", "smg-router"))
    assert env["SMG_PREFILL"]["value"] == "http://10.0.0.1:8000 8998, http://10.0.0.2:8000"
    assert env["SMG_DECODE"]["value"] == "http://10.0.0.3:8000,http://10.0.0.4:8000"


def test_router_flags_in_env_are_real_router_flags(rendered: dict[str, Rendered]) -> None:
    """Every SMG_* variable the chart sets parses as the router's own flag (settings.py reads SMG_X_Y)."""
    from smg_router.settings import build_parser

    flags = {a.dest.upper() for a in build_parser()._actions}
    for config in ("everything", "pd"):
        for name in env_of(rendered[config].get("Deployment", "smg-router")):
            assert name.startswith("SMG_") and name[4:] in flags, name


def test_both_deployments_read_the_admin_token_from_the_secret(rendered: dict[str, Rendered]) -> None:
    for config, secret in (("defaults", "smg-admin"), ("cluster-wide-ha", "mine")):
        r = rendered[config]
        for name in ("smg-router", "smg-operator"):
            ref = env_of(r.get("Deployment", name))["SMG_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret, "key": "admin-api-key"}, (config, name)
    assert [s["metadata"]["name"] for s in rendered["cluster-wide-ha"].of_kind("Secret")] == [
        "smg-peers",
        "smg-checksum-salt",
    ]


def test_admin_token_generated_or_given() -> None:
    first = base64.b64decode(render().get("Secret", "smg-admin")["data"]["admin-api-key"]).decode()
    second = base64.b64decode(render().get("Secret", "smg-admin")["data"]["admin-api-key"]).decode()
    assert len(first) == 32 and first.isalnum() and first != second
    given = render({"auth": {"adminApiKey": "s3cret"}}).get("Secret", "smg-admin")
    assert base64.b64decode(given["data"]["admin-api-key"]) == b"s3cret"
    # kept across upgrades by lookup (shown on the real API server: tests/kube/test_chart_on_apiserver.py)
    assert 'lookup "v1" "Secret"' in (CHART / "templates" / "_helpers.tpl").read_text()


def test_operator_is_told_the_router_service(rendered: dict[str, Rendered]) -> None:
    args = args_of(rendered["defaults"].get("Deployment", "smg-operator"))
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--router-service"] == "smg-router"
    assert pairs["--router-namespace"] == "smg"
    assert pairs["--router-port"] == "30001"  # the router's admin port
    assert pairs["--namespace"] == "smg"
    assert "--leader-election" not in args
    container = rendered["defaults"].get("Deployment", "smg-operator")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["smg-operator"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    ha = args_of(rendered["cluster-wide-ha"].get("Deployment", "smg-operator"))
    assert "--namespace" not in ha
    assert ha[ha.index("--leader-election-namespace") + 1] == "smg" and "--leader-election" in ha


@pytest.mark.parametrize(
    "values, message",
    [
        ({"sim": {"enabled": True, "pd": {"enabled": True}}}, "sim.pd.enabled needs router.pd.enabled"),
        ({"router": {"pd": {"enabled": True}}, "sim": {"enabled": True}}, "needs sim.pd.enabled"),
        ({"router": {"pd": {"enabled": True}, "workerUrls": ["http://a:1"]}}, "cannot be combined"),
        ({"router": {"pd": {"decode": ["http://a:1"]}}}, "need router.pd.enabled"),
    ],
)
def test_inconsistent_values_fail_to_render(values: dict, message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(values)


def test_pods_run_as_non_root_without_privileges(rendered: dict[str, Rendered]) -> None:
    for deployment in rendered["everything"].of_kind("Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_notes_explain_access_workers_and_dashboard(rendered: dict[str, Rendered]) -> None:
    notes = rendered["defaults"].notes
    assert "port-forward svc/smg-router 30000:30000" in notes
    assert "kind: SMGWorker" in notes and "dashboards/smg.json" in notes
    assert 'grafana_dashboard: "1"' in rendered["monitoring"].notes
    assert "smg-sim" in rendered["sim"].notes


# -- validity of every rendered object ------------------------------------------------------------------------


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_rendered_objects_validate_strictly(rendered: dict[str, Rendered], config: str, kube: str) -> None:
    skipped, errors = set(), []
    for obj in rendered[config].all:
        if obj["kind"] in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, kube, strict=True)
            skipped.add(obj["kind"])
            continue
        try:
            kubernetes_validate.validate(obj, kube, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, "\n".join(errors)
    assert skipped <= CUSTOM_KINDS


def test_strict_validation_catches_unknown_fields(rendered: dict[str, Rendered]) -> None:
    router = json.loads(json.dumps(rendered["defaults"].get("Deployment", "smg-router")))
    router["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, "1.30", strict=True)


# Relaxed, with any consistent sequence indentation: Helm's toYaml writes "key:\n- item" while the templates
# indent their own lists.
YAMLLINT = YamlLintConfig(
    "extends: relaxed\nrules:\n  line-length: {max: 160}\n"
    "  indentation: {spaces: consistent, indent-sequences: whatever}\n"
)
# The dashboard ConfigMap carries JSON whose PromQL strings cannot be wrapped: no line-length rule there.
YAMLLINT_DASHBOARD = YamlLintConfig("extends: relaxed\nrules:\n  line-length: disable\n")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_rendered_yaml_passes_yamllint(rendered: dict[str, Rendered], config: str) -> None:
    problems = []
    for path, text in rendered[config].manifests.items():
        if path.endswith(".txt") or not text.strip():
            continue
        config = YAMLLINT_DASHBOARD if path.endswith("dashboard-configmap.yaml") else YAMLLINT
        problems += [f"{path}:{p.line}:{p.column} {p.level} {p.desc} ({p.rule})" for p in linter.run(text, config)]
    assert not problems, "\n".join(problems)


def test_values_file_and_examples_pass_yamllint() -> None:
    for path in [CHART / "values.yaml", CHART / "Chart.yaml", *EXAMPLES]:
        problems = list(linter.run(path.read_text(), YAMLLINT))
        assert not problems, f"{path}: {problems}"
        yaml.safe_load(path.read_text())
