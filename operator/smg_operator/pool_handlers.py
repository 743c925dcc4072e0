"""kopf handlers of the InferencePool source, thin: a pool index and event pokes for ``pool_sync``.

Registered only with ``--inference-pools`` on (``install``, called by ``__main__``): a cluster without the
Gateway API Inference Extension has no such resource, and an operator without the RBAC for it must not watch it.
The event handlers are coroutines: kopf runs plain functions in a thread, where the loop's task cannot be
started nor its event set.  None of these handlers writes: no finalizer, no status, no annotation on a pool
(kopf's event and index handlers store no progress on the object).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from smg_operator.desired import pod_info
from smg_operator.inference_pools import POOL_GROUP, POOL_PLURAL, POOL_VERSION, PoolInfo, pool_info
from smg_operator.pool_sync import Indexes, PoolSync

_installed: set[int] = set()


def _sync(memo: kopf.Memo, kwargs: Mapping[str, Any]) -> PoolSync | None:
    """The loop (kept in kopf's memo by ``__main__``; None when this run has the source off), started on the first
    event: kopf calls event handlers only once every index is filled."""
    sync: PoolSync | None = getattr(memo, "pools", None)
    if sync is not None:
        sync.start(
            Indexes(pools=kwargs["inferencepools_index"], pods=kwargs["pods_index"], services=kwargs["services_index"])
        )
    return sync


def inferencepools_index(
    body: kopf.Body, namespace: str | None, name: str, **_: Any
) -> dict[tuple[str, str], PoolInfo]:
    return {(namespace or "", name): pool_info(body)}


async def inferencepool_changed(memo: kopf.Memo, **kwargs: Any) -> None:
    if (sync := _sync(memo, kwargs)) is not None:
        sync.poke()


async def pod_changed_for_pools(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    if (sync := _sync(memo, kwargs)) is not None:
        sync.poke_pod(pod_info(body))


async def service_changed_for_pools(namespace: str | None, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    if (sync := _sync(memo, kwargs)) is not None:
        sync.poke_service(namespace or "", name)


def install(registry: kopf.OperatorRegistry) -> None:
    """Register the handlers above in ``registry`` (once per registry)."""
    if id(registry) in _installed:
        return
    _installed.add(id(registry))
    kopf.index(POOL_GROUP, POOL_VERSION, POOL_PLURAL, registry=registry)(inferencepools_index)
    kopf.on.event(POOL_GROUP, POOL_VERSION, POOL_PLURAL, registry=registry)(inferencepool_changed)
    kopf.on.event("pods", registry=registry)(pod_changed_for_pools)
    kopf.on.event("services", registry=registry)(service_changed_for_pools)
