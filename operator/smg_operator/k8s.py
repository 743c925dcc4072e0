"""The only module that calls the Kubernetes API directly (kopf does the watching).

Status patches, Events, the leader-election Lease and the uninstall hook's sweep of SMGWorkers, through the
official ``kubernetes`` client (sync, run in a thread).  Every call carries ``_request_timeout`` and the client
makes no retries of its own, so a call ends within the request timeout whatever the network does.  Status
patches and Events are writes: they go through the leadership ``Gate`` and are refused once this replica stops
leading.  Races a real API server shows are tolerated here: an object deleted while we patch it is a 404 to
ignore, not a crash.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from smg_operator.desired import GROUP, PLURAL, VERSION
from smg_operator.leadership import Gate, GateClosed, LeaseRecord, StoredLease

log = logging.getLogger(__name__)


def load_config() -> None:
    """In-cluster configuration when running in a pod, else the standard kubeconfig ($KUBECONFIG).

    urllib3's own retries are turned off: by default it retries a failed connect three times, each up to the
    request timeout, which would stretch one call past the renew deadline the timeout is sized for."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]  # the kubernetes client leaves it unannotated
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]  # likewise
    cfg = client.Configuration.get_default_copy()
    cfg.retries = False
    client.Configuration.set_default(cfg)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def served(group: str, version: str, plural: str, *, timeout: float) -> bool:
    """Whether the API server serves ``plural`` in ``group/version`` (discovery; a missing CRD is False)."""
    try:
        found = client.CustomObjectsApi().get_api_resources(group, version, _request_timeout=timeout)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return any(r.name == plural for r in found.resources or [])


class KubeWrites:
    """The reconciler's Kubernetes writes (``reconciler.Kube``): through ``gate``, each within ``timeout`` s."""

    def __init__(self, *, gate: Gate, timeout: float) -> None:
        self._gate, self._timeout = gate, timeout

    @staticmethod
    def now_iso() -> str:
        return now_iso()

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Merge-patch the SMGWorker's status subresource; False when the object is already gone."""
        api = client.CustomObjectsApi()
        try:
            await self._gate.run(
                asyncio.to_thread(
                    api.patch_namespaced_custom_object_status,
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    name,
                    {"status": dict(status)},
                    _request_timeout=self._timeout,
                )
            )
        except ApiException as e:
            if e.status == 404:
                log.debug("SMGWorker %s/%s is gone; status not written", namespace, name)
                return False
            raise
        return True

    async def post_event(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        type: str,
        reason: str,
        message: str,
        kind: str = "SMGWorker",
        api_version: str = f"{GROUP}/{VERSION}",
    ) -> None:
        """A core/v1 Event about an SMGWorker (or another object: an InferencePool).  API failures are logged,
        never raised (events are best effort); a closed gate raises ``GateClosed`` like every other refused write."""
        now = datetime.datetime.now(datetime.UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{name}.", namespace=namespace),
            involved_object=client.V1ObjectReference(
                api_version=api_version, kind=kind, name=name, namespace=namespace, uid=uid
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
        create = client.CoreV1Api().create_namespaced_event
        try:
            await self._gate.run(asyncio.to_thread(create, namespace, event, _request_timeout=self._timeout))
        except GateClosed:
            raise
        except Exception as e:
            log.warning("could not post event %s on %s/%s: %s: %s", reason, namespace, name, e.__class__.__name__, e)


class LeaseStore:
    """``leadership.LeaseStore`` on a coordination.k8s.io/v1 Lease; sync, each call within ``timeout`` s."""

    def __init__(self, *, namespace: str, name: str = "smg-operator", timeout: float) -> None:
        self.namespace, self.name, self._timeout = namespace, name, timeout
        self._api = client.CoordinationV1Api()

    @staticmethod
    def _spec(record: LeaseRecord) -> client.V1LeaseSpec:
        return client.V1LeaseSpec(
            holder_identity=record.holder,
            lease_duration_seconds=record.duration,
            acquire_time=record.acquire_time,
            renew_time=record.renew_time,
            lease_transitions=record.transitions,
        )

    def get(self) -> StoredLease | None:
        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace, _request_timeout=self._timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        spec = lease.spec or client.V1LeaseSpec()  # a Lease without a spec (made by hand) is a free one
        record = LeaseRecord(
            holder=spec.holder_identity or None,
            duration=spec.lease_duration_seconds,
            acquire_time=spec.acquire_time,
            renew_time=spec.renew_time,
            transitions=spec.lease_transitions or 0,
        )
        version = lease.metadata.resource_version if lease.metadata else None
        if not version:
            raise ValueError(f"Lease {self.namespace}/{self.name} came back without a resourceVersion")
        return StoredLease(record, version)

    def create(self, record: LeaseRecord) -> bool:
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace), spec=self._spec(record)
        )
        try:
            self._api.create_namespaced_lease(self.namespace, body, _request_timeout=self._timeout)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def update(self, record: LeaseRecord, *, version: str) -> bool:
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace, resource_version=version),
            spec=self._spec(record),
        )
        try:
            self._api.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=self._timeout)
        except ApiException as e:
            if e.status == 409:  # someone else wrote it since we read it
                return False
            raise
        return True


class SMGWorkerSweep:
    """Deletes the SMGWorkers a label selector picks in one namespace and tells which are still there (the
    chart's pre-delete hook, ``smg_operator.uninstall``); sync, each call within ``timeout`` s."""

    def __init__(self, *, namespace: str, selector: str, timeout: float) -> None:
        self.namespace, self.selector, self._timeout = namespace, selector, timeout
        self._api = client.CustomObjectsApi()

    def names(self) -> list[str]:
        listed = self._api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, label_selector=self.selector, _request_timeout=self._timeout
        )
        assert isinstance(listed, dict)  # the client's JSON of a list: {"items": [...], ...}
        return sorted(item["metadata"]["name"] for item in listed["items"])

    def delete(self) -> list[str]:
        """Asks for the deletion of every match (the operator's finalizer then deregisters it); returns their names."""
        names = self.names()
        for name in names:
            try:
                self._api.delete_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, name, _request_timeout=self._timeout
                )
            except ApiException as e:
                if e.status != 404:  # already gone: what we asked for
                    raise
        return names
