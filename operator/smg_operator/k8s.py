"""The only module that calls the Kubernetes API directly (kopf does the watching).

Status patches, Events and the leader-election Lease, through the official ``kubernetes`` client (sync,
run in a thread).  Races a real API server shows are tolerated here: an object deleted while we patch
it is a 404 to ignore, not a crash.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from smg_operator.desired import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)


def load_config() -> None:
    """In-cluster configuration when running in a pod, else the standard kubeconfig ($KUBECONFIG)."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]  # the kubernetes client leaves it unannotated
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]  # likewise


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def patch_status(namespace: str, name: str, status: Mapping[str, Any]) -> bool:
    """Merge-patch the SMGWorker's status subresource; False when the object is already gone."""
    api = client.CustomObjectsApi()
    try:
        await asyncio.to_thread(
            api.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)}
        )
    except ApiException as e:
        if e.status == 404:
            log.debug("SMGWorker %s/%s is gone; status not written", namespace, name)
            return False
        raise
    return True


async def post_event(*, namespace: str, name: str, uid: str, type: str, reason: str, message: str) -> None:
    """A core/v1 Event about an SMGWorker; failures are logged, never raised (events are best effort)."""
    now = datetime.datetime.now(datetime.UTC)
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name=f"{name}.", namespace=namespace),
        involved_object=client.V1ObjectReference(
            api_version=f"{GROUP}/{VERSION}", kind="SMGWorker", name=name, namespace=namespace, uid=uid
        ),
        type=type,
        reason=reason,
        message=message[:1024],
        count=1,
        first_timestamp=now,
        last_timestamp=now,
        source=client.V1EventSource(component="smg-operator"),
        reporting_component="smg-operator",
        reporting_instance=socket.gethostname(),
    )
    try:
        await asyncio.to_thread(client.CoreV1Api().create_namespaced_event, namespace, event)
    except (ApiException, OSError) as e:
        log.warning("could not post event %s on %s/%s: %s", reason, namespace, name, e)


class LeaderLease:
    """Lease-based leader election (coordination.k8s.io/v1): only the holder runs the operator's handlers."""

    def __init__(
        self, *, namespace: str, name: str = "smg-operator", identity: str | None = None, duration: int = 15
    ) -> None:
        self.namespace, self.name = namespace, name
        # hostname (the pod name) + pid: unique per process, and the same again for a restarted container (pid 1)
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.duration = duration
        self._api = client.CoordinationV1Api()

    def _spec(self, acquire: bool, transitions: int) -> client.V1LeaseSpec:
        now = datetime.datetime.now(datetime.UTC)
        return client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=self.duration,
            renew_time=now,
            acquire_time=now if acquire else None,
            lease_transitions=transitions,
        )

    def try_acquire(self) -> bool:
        """Take or renew the lease if it is free, expired or ours (optimistic concurrency on resourceVersion)."""
        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace), spec=self._spec(True, 0)
            )
            try:
                self._api.create_namespaced_lease(self.namespace, body)
            except ApiException as e2:
                if e2.status == 409:
                    return False
                raise
            return True
        spec = lease.spec or client.V1LeaseSpec()  # a Lease without a spec (made by hand) is a free one
        holder = spec.holder_identity
        renewed = spec.renew_time
        expired = renewed is None or (datetime.datetime.now(datetime.UTC) - renewed).total_seconds() > (
            spec.lease_duration_seconds or self.duration
        )
        if holder not in (None, "", self.identity) and not expired:
            return False
        ours = holder == self.identity
        lease.spec = self._spec(not ours, (spec.lease_transitions or 0) + (0 if ours else 1))
        try:
            self._api.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as e:
            if e.status == 409:  # someone else won the race
                return False
            raise
        return True

    async def acquire(self, *, retry: float = 2.0) -> None:
        standing_by = False
        while not await asyncio.to_thread(self.try_acquire):  # polls a remote lock
            if not standing_by:  # said once: a standby polls for as long as the leader lives
                log.info(
                    "leader election: lease %s/%s is held by another replica; %s stands by",
                    self.namespace,
                    self.name,
                    self.identity,
                )
                standing_by = True
            await asyncio.sleep(retry)
        log.info("leader election: %s holds lease %s/%s", self.identity, self.namespace, self.name)

    def release(self) -> None:
        """Give the lease up on a clean exit, so a standby takes over at once instead of after expiry."""
        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec is not None and lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                lease.spec.renew_time = None
                self._api.replace_namespaced_lease(self.name, self.namespace, lease)
                log.info("leader election: released lease %s/%s", self.namespace, self.name)
        except (ApiException, OSError) as e:
            log.warning("leader election: could not release the lease: %s", e)

    async def keep(self, *, lost: asyncio.Event) -> None:
        """Renew every third of the duration; set ``lost`` and return when renewal fails."""
        while True:
            await asyncio.sleep(self.duration / 3)
            try:
                ok = await asyncio.to_thread(self.try_acquire)
            except (ApiException, OSError) as e:
                log.warning("leader election: renewal failed: %s", e)
                ok = False
            if not ok:
                log.error("leader election: lost lease %s/%s", self.namespace, self.name)
                lost.set()
                return
