"""The admin token: one value per render shared by the Secret and the pods' checksum, stable when given, and a
checksum annotation on the router and operator pod templates that changes when the token does.

Offline (``helm template``) ``lookup`` finds nothing: an ``existingSecret``'s data cannot be known, so the
checksum is left out and the render stays byte-identical; a generated token is new on every render.  What
``lookup`` does on install and upgrade is shown on the real API server (tests/kube/test_chart_on_apiserver.py).
"""

from __future__ import annotations

import hashlib

import kubernetes_validate
import pytest
from support.helm_chart import Rendered, render

ANNOTATION = "checksum/admin-token"
PODS = ("smg-router", "smg-operator")


def checksum(r: Rendered, deployment: str) -> str | None:
    template = r.get("Deployment", deployment)["spec"]["template"]
    return (template["metadata"].get("annotations") or {}).get(ANNOTATION)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def salted(r: Rendered, data: str) -> str:
    """The checksum of a Secret's value as the chart writes it: salted with the chart's salt Secret's value."""
    salt = r.get("Secret", "smg-checksum-salt")["data"]["salt"]
    return sha256(f"{salt}\n{data}")


PINNED = {"auth": {"checksumSalt": "s"}, "router": {"peers": {"secret": "p"}}}
"""Values that leave nothing to chance but the admin token."""


def test_a_generated_token_is_one_value_for_the_secret_and_both_checksums() -> None:
    r = render()
    data = r.get("Secret", "smg-admin")["data"]["admin-api-key"]
    assert checksum(r, "smg-router") == checksum(r, "smg-operator") == salted(r, data)
    assert checksum(r, "smg-router") != sha256(data)  # salted: the annotation is no oracle for guesses of the token


def test_the_checksum_follows_a_given_token() -> None:
    a, a_again, b = (
        render({**PINNED, "auth": {"adminApiKey": key, "checksumSalt": "s"}})
        for key in ("token-a", "token-a", "token-b")
    )
    for deployment in PODS:
        assert (
            checksum(a, deployment) == checksum(a_again, deployment) == sha256("cw==\ndG9rZW4tYQ==")
        )  # b64 s, token-a
        assert checksum(b, deployment) == sha256("cw==\ndG9rZW4tYg==") != checksum(a, deployment)
    assert a.manifests == a_again.manifests


def test_two_renders_with_an_existing_secret_are_byte_identical() -> None:
    values = {
        "auth": {"existingSecret": "team-admin", "secretKey": "token"},
        "router": {"peers": {"existingSecret": "team-peers"}},
    }
    first, second = render(values), render(values)
    assert first.manifests == second.manifests
    assert not first.of_kind("Secret")  # nor a salt: no checksum to salt
    for deployment in PODS:
        # helm template cannot read the Secret: no checksum rather than a made-up one
        assert checksum(first, deployment) is None
        env = first.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]["env"]
        (ref,) = [e for e in env if e["name"] == "SMG_ADMIN_API_KEY"]
        assert ref == {
            "name": "SMG_ADMIN_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "team-admin", "key": "token"}},
        }


def test_user_pod_annotations_sit_beside_the_checksum() -> None:
    r = render({"router": {"podAnnotations": {"team": "infra"}}, "operator": {"podAnnotations": {"a": "b"}}})
    router = r.get("Deployment", "smg-router")["spec"]["template"]["metadata"]["annotations"]
    operator = r.get("Deployment", "smg-operator")["spec"]["template"]["metadata"]["annotations"]
    assert set(router) == {ANNOTATION, "checksum/peer-secret", "team"} and set(operator) == {ANNOTATION, "a"}
    with_secret = render(
        {
            "auth": {"existingSecret": "s"},
            "router": {"podAnnotations": {"team": "infra"}, "peers": {"existingSecret": "p"}},
        }
    )
    assert with_secret.get("Deployment", "smg-router")["spec"]["template"]["metadata"]["annotations"] == {
        "team": "infra"
    }


@pytest.mark.parametrize("auth", [{}, {"existingSecret": "team-admin"}, {"adminApiKey": "k"}])
def test_helm_template_without_lookup_renders_a_valid_chart(auth: dict) -> None:
    for obj in render({"auth": auth}).objects:
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_a_token_and_an_existing_secret_together_are_refused() -> None:
    with pytest.raises(Exception, match="exclude each other"):
        render({"auth": {"existingSecret": "s", "adminApiKey": "k"}})
