"""The operator's RBAC grants exactly the Kubernetes calls smg-operator makes, no more, in every mode.

The calls (the operator's fixed interface): pods and services get/list/watch; smgworkers get/list/watch/
patch/update, smgworkers/status get/patch/update, smgworkers/finalizers update; events create/patch (core
and events.k8s.io); leases get/update/patch of the Lease smg-operator alone (resourceNames) and create (which
Kubernetes cannot scope to a name) only with leader election; and for kopf's discovery, even
when it watches one namespace, customresourcedefinitions and namespaces list/watch (cluster-scoped); with the
InferencePool source on (operator.inferencePools.enabled, or epp.enabled rendering a pool), inferencepools
get/list/watch (read only: the pool and its status are the gateway's).  The pre-delete hook
``smg-operator-uninstall`` runs under a ServiceAccount of its own: smgworkers list/delete in the release
namespace, and nothing else.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from support.helm_chart import NAMESPACE, Rendered, render

Grant = tuple[str, str, str]  # (apiGroup, resource, verb); a rule scoped to one name: resource "<resource>:<name>"


def grants(*rules: tuple[str, str, str]) -> set[Grant]:
    out = set()
    for group, resource, verbs in rules:
        out |= {(group, resource, verb) for verb in verbs.split()}
    return out


NAMESPACED = grants(
    ("", "pods", "get list watch"),
    ("", "services", "get list watch"),
    ("smg.dev", "smgworkers", "get list watch patch update"),
    ("smg.dev", "smgworkers/status", "get patch update"),
    ("smg.dev", "smgworkers/finalizers", "update"),
    ("", "events", "create patch"),
    ("events.k8s.io", "events", "create patch"),
)
DISCOVERY = grants(
    ("apiextensions.k8s.io", "customresourcedefinitions", "list watch"),
    ("", "namespaces", "list watch"),
)
LEASES = grants(
    ("coordination.k8s.io", "leases:smg-operator", "get update patch"),  # smg_operator.k8s.LeaseStore's one Lease
    ("coordination.k8s.io", "leases", "create"),
)
POOLS = grants(("inference.networking.k8s.io", "inferencepools", "get list watch"))
UNINSTALL = grants(("smg.dev", "smgworkers", "list delete"))
OPERATOR_SA = {"kind": "ServiceAccount", "name": "smg-operator", "namespace": NAMESPACE}
UNINSTALL_SA = {"kind": "ServiceAccount", "name": "smg-operator-uninstall", "namespace": NAMESPACE}
HOOK = {
    "helm.sh/hook": "pre-delete",
    "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded",
}


def rule_grants(role: dict) -> set[Grant]:
    out: set[Grant] = set()
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule, rule
        names = rule.get("resourceNames")
        assert names is None or len(names) == 1, rule  # one name, or none
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                if names is not None:
                    resource = f"{resource}:{names[0]}"
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {role['metadata']['name']}: {rule}"
                    out.add((group, resource, verb))
    return out


def bound_grants(r: Rendered, sa: dict[str, str] = OPERATOR_SA) -> dict[tuple[str, str], set[Grant]]:
    """What ``sa`` may do: (scope, namespace) → grants, through the rendered bindings.  Every binding names the
    operator's ServiceAccount or the uninstall hook's, never anybody else."""
    roles = {("Role", o["metadata"]["namespace"], o["metadata"]["name"]): o for o in r.of_kind("Role")}
    roles |= {("ClusterRole", "", o["metadata"]["name"]): o for o in r.of_kind("ClusterRole")}
    out: dict[tuple[str, str], set[Grant]] = defaultdict(set)
    for binding in r.of_kind("RoleBinding") + r.of_kind("ClusterRoleBinding"):
        assert binding["subjects"] in ([OPERATOR_SA], [UNINSTALL_SA]), binding
        if binding["subjects"] != [sa]:
            continue
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        cluster = binding["kind"] == "ClusterRoleBinding"
        ns = "" if cluster else binding["metadata"]["namespace"]
        key = (ref["kind"], "" if ref["kind"] == "ClusterRole" else ns, ref["name"])
        assert key in roles, f"{binding['kind']}/{binding['metadata']['name']} refers to a missing {key}"
        out[("cluster" if cluster else "namespace", ns)] |= rule_grants(roles[key])
    bound = {
        k
        for b in r.of_kind("RoleBinding") + r.of_kind("ClusterRoleBinding")
        for k in [
            (
                b["roleRef"]["kind"],
                "" if b["roleRef"]["kind"] == "ClusterRole" else b["metadata"]["namespace"],
                b["roleRef"]["name"],
            )
        ]
    }
    assert set(roles) == bound, f"roles without a binding: {set(roles) - bound}"
    return dict(out)


def test_default_namespaced_rbac() -> None:
    assert bound_grants(render()) == {
        ("namespace", NAMESPACE): NAMESPACED,
        ("cluster", ""): DISCOVERY,
    }


def test_leader_election_adds_leases_only_with_more_than_one_replica() -> None:
    assert bound_grants(render({"operator": {"replicas": 2}})) == {
        ("namespace", NAMESPACE): NAMESPACED | LEASES,
        ("cluster", ""): DISCOVERY,
    }
    assert bound_grants(render({"operator": {"replicas": 1}})) == bound_grants(render())


def test_cluster_wide_rbac() -> None:
    r = render({"operator": {"clusterWide": True}})
    assert not [o for o in r.of_kind("Role") + r.of_kind("RoleBinding") if "uninstall" not in o["metadata"]["name"]]
    assert bound_grants(r) == {("cluster", ""): NAMESPACED | DISCOVERY}
    ha = render({"operator": {"clusterWide": True, "replicas": 3}})
    assert bound_grants(ha) == {("cluster", ""): NAMESPACED | DISCOVERY, ("namespace", NAMESPACE): LEASES}


def test_watched_namespaces_get_a_role_each_and_the_router_namespace_too() -> None:
    r = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    assert bound_grants(r) == {
        ("namespace", "team-a"): NAMESPACED,
        ("namespace", "team-b"): NAMESPACED,
        ("namespace", NAMESPACE): NAMESPACED,  # the router's pods and Service live here
        ("cluster", ""): DISCOVERY,
    }
    args = r.get("Deployment", "smg-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    watched = [args[i + 1] for i, a in enumerate(args) if a == "--namespace"]
    assert watched == ["team-a", "team-b"]


POOL_SOURCE = {"operator": {"inferencePools": {"enabled": True}}}
EPP = {"epp": {"enabled": True, "inferencePool": {"selector": {"app": "llama"}, "model": "m"}}}


@pytest.mark.parametrize("values", [POOL_SOURCE, EPP], ids=["inferencePools", "epp"])
def test_the_pool_source_adds_read_only_inferencepools_where_the_operator_watches(values: dict) -> None:
    assert bound_grants(render(values)) == {
        ("namespace", NAMESPACE): NAMESPACED | POOLS,
        ("cluster", ""): DISCOVERY,
    }
    wide = render({**values, "operator": {**values.get("operator", {}), "clusterWide": True}})
    assert bound_grants(wide) == {("cluster", ""): NAMESPACED | DISCOVERY | POOLS}
    own_pool = {"epp": {"enabled": True, "inferencePool": {"create": False}}}  # a pool of yours, not taken
    assert bound_grants(render(own_pool)) == bound_grants(render())


def test_union_of_grants_is_exactly_the_operator_calls() -> None:
    """Over every mode, nothing is granted that is not in the operator's list of calls."""
    everything: set[Grant] = set()
    for values in (
        {},
        {"operator": {"replicas": 2}},
        {"operator": {"clusterWide": True, "replicas": 2}},
        {"operator": {"clusterWide": True, "replicas": 2, "inferencePools": {"enabled": True}}},
    ):
        for granted in bound_grants(render(values)).values():
            everything |= granted
    assert everything == NAMESPACED | DISCOVERY | LEASES | POOLS


@pytest.mark.parametrize("values", [{}, {"operator": {"clusterWide": True, "replicas": 2}}])
def test_uninstall_hook_may_only_list_and_delete_smgworkers_of_the_release_namespace(values: dict) -> None:
    r = render(values)
    assert bound_grants(r, UNINSTALL_SA) == {("namespace", NAMESPACE): UNINSTALL}
    hook_objects = [o for o in r.objects if o["metadata"].get("annotations", {}).get("helm.sh/hook")]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in hook_objects) == [
        ("Job", "smg-operator-uninstall"),
        ("Role", "smg-operator-uninstall"),
        ("RoleBinding", "smg-operator-uninstall"),
        ("ServiceAccount", "smg-operator-uninstall"),
    ]
    for o in hook_objects:  # every one removed after success, and replaced by a rerun's
        assert HOOK.items() <= o["metadata"]["annotations"].items(), o["metadata"]
    weight = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hook_objects}
    assert max(weight[k] for k in ("ServiceAccount", "Role", "RoleBinding")) < weight["Job"]  # RBAC first
    pod = r.get("Job", "smg-operator-uninstall")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "smg-operator-uninstall" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"] == ["smg-operator-uninstall"]
    assert container["args"] == [
        "--namespace",
        NAMESPACE,
        "--selector",
        "app.kubernetes.io/instance=smg,app.kubernetes.io/managed-by=Helm",
        "--timeout",
        "240",
    ]
    # the selector picks exactly the release's SMGWorkers (from values and the sim fleet)
    extra = {"role": "regular", "model": "m", "selector": {"matchLabels": {"app": "m"}}, "port": 8000}
    with_sim = render({**values, "sim": {"enabled": True}, "smgWorkers": [{"name": "extra", "spec": extra}]})
    picked = [
        o["metadata"]["name"]
        for o in with_sim.of_kind("SMGWorker")
        if o["metadata"]["labels"].get("app.kubernetes.io/instance") == "smg"
        and o["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "Helm"
    ]
    assert len(picked) == len(with_sim.of_kind("SMGWorker")) >= 2, picked


def test_uninstall_hook_can_be_turned_off() -> None:
    r = render({"operator": {"uninstallHook": {"enabled": False}}})
    assert not [o for o in r.objects if "uninstall" in o["metadata"]["name"]]


@pytest.mark.parametrize("values", [{}, {"operator": {"clusterWide": True}}])
def test_router_has_no_api_access(values: dict) -> None:
    r = render(values)
    router_sa = r.get("ServiceAccount", "smg-router")
    assert router_sa["automountServiceAccountToken"] is False
    for binding in r.of_kind("RoleBinding") + r.of_kind("ClusterRoleBinding"):
        assert all(s["name"] != "smg-router" for s in binding["subjects"])


def test_operator_disabled_renders_no_rbac() -> None:
    r = render({"operator": {"enabled": False}})
    for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert not r.of_kind(kind)
    assert [d["metadata"]["name"] for d in r.of_kind("Deployment")] == ["smg-router"]
