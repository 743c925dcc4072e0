"""The e2e tier: SMG's image and chart in a real Kubernetes cluster (support/e2e_cluster.py says which one).

Fixtures: ``cluster`` (brought up here, or an existing one) and ``image`` (built from the repository's
Dockerfile and loaded into the node) are module-scoped, so the cluster goes down as soon as the e2e module is
done, not at the end of a whole-suite session; ``figures`` (what the tests measured, printed at the end of the
session for docs/helm.md).  The tier skips, with the reason, only when
the machine cannot run a cluster (no root, no namespaces) and no other cluster is given.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.e2e_cluster import Cluster, Unavailable, provide_cluster


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    yield found
    if found:
        print("\ne2e figures: " + json.dumps(found, sort_keys=True))


@pytest.fixture(scope="module")
def cluster(figures: dict[str, Any]) -> Iterator[Cluster]:
    started = time.monotonic()
    provider = provide_cluster()
    try:
        c = next(provider)
    except Unavailable as e:
        pytest.skip(str(e))
    figures["backend"] = c.backend
    figures["cluster_up_s"] = round(time.monotonic() - started, 1)
    yield c
    stopped = time.monotonic()
    with pytest.raises(StopIteration):
        next(provider)  # the teardown: e2e/cluster/down.sh, or the kind cluster deleted
    figures["cluster_down_s"] = round(time.monotonic() - stopped, 1)


@pytest.fixture(scope="module")
def image(cluster: Cluster, figures: dict[str, Any]) -> str:
    """The image tag the pods run: built and loaded here when the backend can, else SMG_E2E_IMAGE as it is."""
    if cluster.build_image is not None:
        started = time.monotonic()
        size = cluster.build_image(cluster.image)
        figures["image_build_s"] = round(time.monotonic() - started, 1)
        figures["image_size_mb"] = round(size / 1e6, 1)
    return cluster.image
