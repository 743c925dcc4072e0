"""The real control plane itself: kube-apiserver 1.20 + etcd on loopback, the SMGWorker CRD and examples,
schema validation, pods played by the test (ready, terminating, released) and service-account tokens.

Nothing here contacts any address of the examples: they are only stored by the API server.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
from support.kube import HOLD_FINALIZER, KUBE_VERSION, ControlPlane, wait_for

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "smgworker.yaml"
CRD_NAME = "smgworkers.smg.dev"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SMGW_PATH = "/apis/smg.dev/v1alpha1/namespaces/{ns}/smgworkers"

_ns_counter = itertools.count(1)


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    name = f"smg-test-{int(time.time()) % 100000}-{next(_ns_counter)}"
    control_plane.create_namespace(name)
    return name


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> dict:
    control_plane.apply_yaml(CRD_FILE)
    crd = control_plane.wait_crd_established(CRD_NAME)
    # kubectl's client-side validation and `kubectl get` need the CRD's schema in the published OpenAPI.
    wait_for(
        lambda: "dev.smg.v1alpha1.SMGWorker" in control_plane.request("GET", "/openapi/v2", raw=True)[1],
        timeout=60,
        interval=0.5,
        what="SMGWorker in /openapi/v2",
    )
    return crd


def smgworker(name: str, **spec_overrides: object) -> dict:
    spec: dict = {"role": "regular", "model": "sim-model", "selector": {"matchLabels": {"app": name}}, "port": 8000}
    spec.update(spec_overrides)
    return {"apiVersion": "smg.dev/v1alpha1", "kind": "SMGWorker", "metadata": {"name": name}, "spec": spec}


# ------------------------------------------------------------------------------------------ the server
def test_api_server_answers(control_plane: ControlPlane) -> None:
    version = control_plane.api("GET", "/version")
    assert version["gitVersion"] == f"v{KUBE_VERSION}"
    assert control_plane.server.startswith("https://127.0.0.1:")
    assert control_plane.request("GET", "/readyz", raw=True) == (200, "ok")
    out = control_plane.kubectl("get", "namespace", "default", "-o", "jsonpath={.status.phase}").stdout
    assert out == "Active"
    # Without a token the API server knows nobody: anonymous requests to resources are forbidden.
    status, body = control_plane.request("GET", "/api/v1/namespaces", token="not-a-token")
    assert status == 401, body


# ---------------------------------------------------------------------------------- CRD and examples
def test_crd_applies_and_becomes_established(control_plane: ControlPlane, crd: dict) -> None:
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions.get("NamesAccepted") == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["smgw"]
    resources = control_plane.kubectl("api-resources", "--api-group=smg.dev", "-o", "name").stdout.split()
    assert resources == ["smgworkers.smg.dev"]


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_applies(control_plane: ControlPlane, crd: dict, namespace: str, example: Path) -> None:
    control_plane.apply_yaml(example, namespace)
    docs = control_plane.kubectl_json("get", "smgw", "-n", namespace)["items"]
    assert len(docs) == 1
    stored = docs[0]
    assert stored["metadata"]["namespace"] == namespace
    assert stored["spec"]["role"] in ("regular", "prefill", "decode")
    # Defaults of the schema are applied by the server.
    assert stored["spec"]["drainTimeoutSeconds"] == 30
    # No default for the router port: unset, the operator's --router-port applies (the chart's admin port).
    assert "port" not in stored["spec"]["router"]


def test_all_examples_apply_together(control_plane: ControlPlane, crd: dict, namespace: str) -> None:
    assert len(EXAMPLES) >= 4
    for example in EXAMPLES:
        control_plane.apply_yaml(example, namespace)
    names = control_plane.kubectl("get", "smgworkers", "-n", namespace, "-o", "name").stdout.split()
    assert len(names) == len(EXAMPLES), names


@pytest.mark.parametrize(
    ("override", "field", "detail"),
    [
        ({"role": "boss"}, "spec.role", 'Unsupported value: "boss"'),
        ({"port": 70000}, "spec.port", "less than or equal to 65535"),
        ({"model": ""}, "spec.model", "at least 1 chars long"),
        ({"endpoints": ["ftp://x"], "selector": None}, "spec.endpoints", "should match"),
        ({"drainTimeoutSeconds": -1}, "spec.drainTimeoutSeconds", "greater than or equal to 0"),
    ],
    ids=["role-boss", "port-70000", "model-empty", "endpoint-scheme", "drain-negative"],
)
def test_invalid_smgworker_is_rejected_by_the_server(
    control_plane: ControlPlane, crd: dict, namespace: str, override: dict, field: str, detail: str
) -> None:
    doc = smgworker("bad", **override)
    doc["spec"] = {k: v for k, v in doc["spec"].items() if v is not None}
    # Straight to the API server: no client-side validation involved.
    status, body = control_plane.request("POST", SMGW_PATH.format(ns=namespace), doc)
    assert status == 422, body
    assert field in body["message"] and detail in body["message"], body["message"]
    assert any(c.get("field") == field for c in body["details"]["causes"]), body["details"]
    # And through kubectl with client-side validation off, the server's message reaches the user.
    proc = control_plane.kubectl(
        "apply", "-n", namespace, "--validate=false", "-f", "-", input=json.dumps(doc), check=False
    )
    assert proc.returncode != 0
    assert 'SMGWorker "bad" is invalid' in proc.stderr, proc.stderr
    assert field in proc.stderr and detail in proc.stderr, proc.stderr
    assert control_plane.kubectl("get", "smgw", "-n", namespace, "-o", "name").stdout == ""


def test_smgworker_needs_a_selector_or_endpoints(control_plane: ControlPlane, crd: dict, namespace: str) -> None:
    doc = smgworker("neither")
    del doc["spec"]["selector"]
    status, body = control_plane.request("POST", SMGW_PATH.format(ns=namespace), doc)
    assert status == 422, body
    assert "spec" in body["message"], body["message"]


def test_unknown_field_colour(control_plane: ControlPlane, crd: dict, namespace: str) -> None:
    """kube-apiserver 1.20 prunes unknown fields of a structural CRD (it has no strict field validation, which
    came in 1.25): the server stores the object without them.  kubectl's own schema validation, against the
    schema the server publishes, is what rejects them, naming the field."""
    doc = smgworker("colourful", colour="blue")
    proc = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0, proc.stdout
    assert "colour" in proc.stderr and "unknown field" in proc.stderr, proc.stderr
    assert control_plane.kubectl("get", "smgw", "-n", namespace, "-o", "name").stdout == ""

    status, body = control_plane.request("POST", SMGW_PATH.format(ns=namespace), doc)
    assert status == 201, body
    assert "colour" not in body["spec"]
    stored = control_plane.kubectl_json("get", "smgw", "colourful", "-n", namespace)
    assert "colour" not in stored["spec"] and stored["spec"]["role"] == "regular"


def test_kubectl_get_smgw_columns(control_plane: ControlPlane, crd: dict, namespace: str) -> None:
    control_plane.apply_yaml(json.dumps(smgworker("cols")), namespace)
    # The status subresource: the main resource ignores status, /status takes it.
    path = SMGW_PATH.format(ns=namespace) + "/cols/status"
    control_plane.api(
        "PATCH",
        path,
        {
            "status": {
                "ready": "2/3",
                "registeredEndpoints": 2,
                "conditions": [
                    {"type": "EndpointsResolved", "status": "True", "reason": "EndpointsFound"},
                    {"type": "Ready", "status": "False", "reason": "ReplicasDisagree"},
                ],
            }
        },
        content_type="application/merge-patch+json",
    )
    lines = control_plane.kubectl("get", "smgw", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "MODEL", "READY", "REGISTERED", "STATUS", "AGE"], lines
    # STATUS is the Ready condition's reason, picked out of the list by type
    assert lines[1].split()[:6] == ["cols", "regular", "sim-model", "2/3", "2", "ReplicasDisagree"], lines


def test_status_is_a_subresource(control_plane: ControlPlane, crd: dict, namespace: str) -> None:
    doc = smgworker("sub")
    doc["status"] = {"ready": "9/9"}
    created = control_plane.api("POST", SMGW_PATH.format(ns=namespace), doc)
    assert "status" not in created or created["status"].get("ready") != "9/9"
    generation = created["metadata"]["generation"]
    updated = control_plane.api(
        "PATCH",
        SMGW_PATH.format(ns=namespace) + "/sub/status",
        {"status": {"ready": "1/1"}},
        content_type="application/merge-patch+json",
    )
    assert updated["status"]["ready"] == "1/1"
    assert updated["metadata"]["generation"] == generation  # a status write does not bump the generation


# ------------------------------------------------------------------------------------- pods by hand
def _ready(pod: dict) -> str | None:
    return next((c["status"] for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)


def test_make_ready_pod(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.make_ready_pod(
        namespace,
        "w1",
        {"app": "pool-a", "role": "worker"},
        "127.0.0.2",
        annotations={"sglang.ai/bootstrap-port": "8998"},
    )
    pod = control_plane.kubectl_json("get", "pod", "w1", "-n", namespace)
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["podIP"] == "127.0.0.2"
    assert pod["status"]["podIPs"] == [{"ip": "127.0.0.2"}]
    assert _ready(pod) == "True"
    assert pod["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == "8998"
    assert pod["spec"]["containers"][0]["image"] == "smg-sim:test"
    # Label selectors work on the real server (the emulator ignores them).
    control_plane.make_ready_pod(namespace, "other", {"app": "pool-b"}, "127.0.0.3")
    names = control_plane.kubectl("get", "pods", "-n", namespace, "-l", "app=pool-a", "-o", "name").stdout.split()
    assert names == ["pod/w1"]

    control_plane.set_pod_ready(namespace, "w1", False)
    pod = control_plane.get_pod(namespace, "w1")
    assert pod is not None and _ready(pod) == "False" and pod["status"]["podIP"] == "127.0.0.2"
    assert pod["status"]["containerStatuses"][0]["ready"] is False
    control_plane.set_pod_ready(namespace, "w1", True)
    pod = control_plane.get_pod(namespace, "w1")
    assert pod is not None and _ready(pod) == "True"


def test_pod_status_only_through_the_subresource(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.make_ready_pod(namespace, "w", {"app": "x"}, "127.0.0.4")
    patched = control_plane.api(
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/w",
        {"status": {"podIP": "127.0.0.9"}},
        content_type="application/merge-patch+json",
    )
    assert patched["status"]["podIP"] == "127.0.0.4"


def test_mark_terminating_and_release(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.make_ready_pod(namespace, "leaving", {"app": "x"}, "127.0.0.5")
    pod = control_plane.mark_terminating(namespace, "leaving")
    assert pod["metadata"]["deletionTimestamp"]
    assert HOLD_FINALIZER in pod["metadata"]["finalizers"]
    # Held, it stays through later writes: the kubelet's status update of a terminating pod (not Ready any
    # more, as during its grace period) lands on it, and a read after that write still finds it.
    written = control_plane.set_pod_ready(namespace, "leaving", False)
    assert written["metadata"]["deletionTimestamp"] and _ready(written) == "False"
    still = control_plane.get_pod(namespace, "leaving")
    assert still is not None and still["metadata"]["deletionTimestamp"]
    assert still["status"]["podIP"] == "127.0.0.5"
    control_plane.release_pod(namespace, "leaving")
    assert control_plane.get_pod(namespace, "leaving") is None
    proc = control_plane.kubectl("get", "pod", "leaving", "-n", namespace, check=False)
    assert proc.returncode != 0 and "NotFound" in proc.stderr


def test_pod_with_own_finalizer_and_unheld_pod(control_plane: ControlPlane, namespace: str) -> None:
    # A finalizer given at creation is kept alongside the test's hold.
    control_plane.make_ready_pod(namespace, "held", {"app": "x"}, "127.0.0.6", finalizers=[HOLD_FINALIZER])
    pod = control_plane.mark_terminating(namespace, "held")
    assert pod["metadata"]["finalizers"] == [HOLD_FINALIZER]
    control_plane.release_pod(namespace, "held")
    assert control_plane.get_pod(namespace, "held") is None
    # Without a finalizer (and no nodeName) a delete removes the pod at once: there is no kubelet grace period.
    control_plane.make_ready_pod(namespace, "gone", {"app": "x"}, "127.0.0.7")
    control_plane.kubectl("delete", "pod", "gone", "-n", namespace, "--wait=false")
    assert control_plane.get_pod(namespace, "gone") is None


# ------------------------------------------------------------------------------ service accounts + RBAC
def test_service_account_token_authenticates(control_plane: ControlPlane, crd: dict, namespace: str) -> None:
    token = control_plane.service_account_token(namespace, "smg-operator")
    user = f"system:serviceaccount:{namespace}:smg-operator"
    review = control_plane.whoami(token)
    assert review["authenticated"] is True, review
    assert review["user"]["username"] == user
    assert "system:serviceaccounts" in review["user"]["groups"]
    claims = ControlPlane.token_claims(token)
    assert claims["sub"] == user and claims["iss"] == ControlPlane.ISSUER

    kubeconfig = control_plane.kubeconfig_for_token(token, namespace=namespace)
    # Authenticated but granted nothing: 403 naming the service account.
    denied = control_plane.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower() and user in denied.stderr, denied.stderr
    status, _ = control_plane.request("GET", f"/api/v1/namespaces/{namespace}/pods", token=token)
    assert status == 403

    control_plane.apply_yaml(
        f"""
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: pod-reader}}
rules:
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [smg.dev]
  resources: [smgworkers/status]
  verbs: [patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: smg-operator-pod-reader}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}}
subjects:
- {{kind: ServiceAccount, name: smg-operator, namespace: {namespace}}}
""",
        namespace,
    )
    control_plane.make_ready_pod(namespace, "visible", {"app": "x"}, "127.0.0.8")
    listed = wait_for(
        lambda: control_plane.kubectl(
            "get", "pods", "-n", namespace, "-o", "name", kubeconfig=kubeconfig, check=False
        ).stdout.split(),
        timeout=15,
        what="RBAC grant to take effect",
    )
    assert listed == ["pod/visible"]

    def can_i(*args: str) -> str:
        return control_plane.kubectl(
            "auth", "can-i", *args, "-n", namespace, kubeconfig=kubeconfig, check=False
        ).stdout.strip()

    assert can_i("list", "pods") == "yes"
    assert can_i("patch", "smgworkers.smg.dev", "--subresource=status") == "yes"
    assert can_i("delete", "pods") == "no"
    assert can_i("list", "smgworkers.smg.dev") == "no"
    # Granted in this namespace only.
    status, _ = control_plane.request("GET", "/api/v1/namespaces/default/pods", token=token)
    assert status == 403
    rules = control_plane.kubectl("auth", "can-i", "--list", "-n", namespace, kubeconfig=kubeconfig).stdout
    assert "pods" in rules and "smgworkers.smg.dev/status" in rules, rules
