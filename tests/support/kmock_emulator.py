"""kmock's stateful Kubernetes emulator, made good enough for kopf 1.45 and the ``kubernetes`` client.

``KubernetesEmulator`` keeps kmock's request log, its DSL for injected reactions (``emu['patch', ...] << 500``)
and its object store (``emu.objects[...]``), and replaces the state-changing part with one that behaves like
a real API server where kopf and the operator can tell the difference:

- discovery knows the built-in resources kopf and the operator touch (namespaces, CRDs, pods, services,
  endpoints, core and events.k8s.io events, leases) and every CRD installed (``install_crd`` or a POST of
  a CustomResourceDefinition): kind, singular, short names, scope, verbs and subresources;
- create stamps ``metadata.uid``, ``resourceVersion``, ``creationTimestamp`` and ``generation``, fills
  ``generateName``, drops ``status`` where the resource has a status subresource (pods start Pending) and
  applies the CRD schema's defaults;
- every change takes the next resourceVersion from one global counter; ``generation`` moves only when
  something outside ``metadata`` (and ``status``, with a status subresource) changes, and when a deletion
  is marked;
- PATCH understands merge patches (RFC 7386; strategic merge patches are treated the same) and JSON
  patches (RFC 6902): a failed ``test`` op, or any op that cannot apply, answers 422; a merge patch carrying
  a stale ``metadata.resourceVersion`` answers 409; a no-op patch changes nothing and sends no event;
- the status subresource is split as on a real server: ``/status`` changes only ``status``, the main
  resource never does; PUT replaces (409 on a stale resourceVersion);
- DELETE of an object with finalizers sets ``deletionTimestamp`` (and no new finalizers may be added);
  removing the last finalizer of such an object deletes it;
- LIST answers the current resourceVersion; WATCH with ``?resourceVersion=N`` replays exactly the events
  after N from a history (410 Gone once N is older than the history), without one gap or duplicate between
  the replay and the live stream; without one (or with 0) it starts with the current objects as ADDED;
  ``timeoutSeconds`` ends the stream.

Not emulated (use the real API server tier for these): label and field selectors, schema validation,
admission, RBAC, authentication (any token is accepted), server-side apply, dry-run, garbage collection
(owner references), a kubelet's graceful pod deletion (give a pod a finalizer of the test's own to see it
terminating), Endpoints controllers, watch bookmarks, and objects written behind the API's back through
``emu.objects[...] = ...`` (they get no resourceVersion and no event: write through HTTP instead).

``EmulatorServer`` runs one emulator as a real HTTP server on 127.0.0.1 in a background thread with its own
event loop, so a test (sync or async) and an operator subprocess can both talk to it, and writes a
kubeconfig for it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import datetime
import json
import secrets
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml

T = TypeVar("T")

VERBS = frozenset({"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"})
BUILTIN_RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {
        "kind": "Namespace",
        "singular": "namespace",
        "namespaced": False,
        "shortnames": {"ns"},
        "subresources": {"status"},
    },
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "singular": "customresourcedefinition",
        "namespaced": False,
        "shortnames": {"crd", "crds"},
        "subresources": {"status"},
    },
    "v1/pods": {
        "kind": "Pod",
        "singular": "pod",
        "namespaced": True,
        "shortnames": {"po"},
        "categories": {"all"},
        "subresources": {"status"},
    },
    "v1/services": {
        "kind": "Service",
        "singular": "service",
        "namespaced": True,
        "shortnames": {"svc"},
        "categories": {"all"},
        "subresources": {"status"},
    },
    "v1/endpoints": {"kind": "Endpoints", "singular": "endpoints", "namespaced": True, "shortnames": {"ep"}},
    "v1/events": {"kind": "Event", "singular": "event", "namespaced": True, "shortnames": {"ev"}},
    "events.k8s.io/v1/events": {"kind": "Event", "singular": "event", "namespaced": True, "shortnames": {"ev"}},
    "coordination.k8s.io/v1/leases": {"kind": "Lease", "singular": "lease", "namespaced": True},
}
CRD_RESOURCE = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
POD_RESOURCE = kmock.resource("v1/pods")
_MUTATIONS = frozenset({kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE})
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what the API server uses for generateName suffixes
_IMMUTABLE_META = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_version(res: kmock.resource) -> str:
    return res.version if not res.group else f"{res.group}/{res.version}"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, ``null`` removes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def apply_schema_defaults(obj: Any, schema: Mapping[str, Any] | None) -> None:
    """Fill absent fields that have a ``default`` in a structural OpenAPI v3 schema, in place."""
    if not schema:
        return
    if isinstance(obj, dict):
        props: Mapping[str, Any] = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in obj and isinstance(sub, Mapping) and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj and key != "metadata":
                apply_schema_defaults(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key, value in obj.items():
                if key not in props:
                    apply_schema_defaults(value, extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for item in obj:
            apply_schema_defaults(item, schema["items"])


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def _header(request: kmock.Request, name: str) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == name.lower()), "")


@attrs.define(kw_only=True)
class KubernetesEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with resource versions, generations, real patch semantics and resumable watches."""

    history_limit: int = 100_000
    """Watch events kept for ``?resourceVersion=`` resumption; older ones answer 410 Gone."""

    _revision: int = attrs.field(default=0, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    """The newest resourceVersion dropped from the history: watches from before it get 410 Gone."""
    _history: collections.deque[tuple[int, kmock.resource, dict[str, Any]]] = attrs.field(
        factory=collections.deque, init=False
    )
    _results: dict[int, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _schemas: dict[kmock.resource, Mapping[str, Any]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # registers the fallbacks; self._serve_* resolve to the overrides below
        self.fallback[kmock.method.PUT] << self._serve_replace
        for key, info in BUILTIN_RESOURCES.items():
            self.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)

    # -- CRDs --------------------------------------------------------------------------------------
    def declare_crd(self, crd: Mapping[str, Any]) -> list[kmock.resource]:
        """Make a CustomResourceDefinition's served versions discoverable (and remember their defaults)."""
        spec, names = crd["spec"], crd["spec"]["names"]
        declared = []
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            res = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[res] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=VERBS,
                shortnames=set(names.get("shortNames") or ()),
                categories=set(names.get("categories") or ()),
                subresources=set((version.get("subresources") or {}).keys()),
            )
            self._schemas[res] = (version.get("schema") or {}).get("openAPIV3Schema") or {}
            declared.append(res)
        return declared

    async def install_crd(self, crd: Mapping[str, Any]) -> dict[str, Any]:
        """Create a CustomResourceDefinition object (from inside the server's loop), as a POST would."""
        request = kmock.Request(action=kmock.action.CREATE, resource=CRD_RESOURCE, data=dict(crd))
        async with self._lock:
            return await self._create(request)

    def _undeclare_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec") or {}
        for version in spec.get("versions") or []:
            res = kmock.resource(spec.get("group"), version.get("name"), (spec.get("names") or {}).get("plural"))
            self._schemas.pop(res, None)
            if res in self.resources:
                del self.resources[res]

    # -- helpers -----------------------------------------------------------------------------------
    def _info(self, res: kmock.resource | None) -> kmock.ResourceInfo:
        if res is None or res not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        return self.resources[res]

    def _has_status_subresource(self, res: kmock.resource) -> bool:
        return "status" in self._info(res).subresources

    def _next_version(self) -> str:
        self._revision += 1
        return str(self._revision)

    def _live(self, key: tuple[kmock.resource, str | None, str]) -> kmock.Object | None:
        if key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else obj

    def _spec_part(self, res: kmock.resource, body: Mapping[str, Any]) -> dict[str, Any]:
        """What a change of bumps ``generation``: everything but metadata (and status, with the subresource)."""
        skip = {"metadata", "status"} if self._has_status_subresource(res) else {"metadata"}
        return {k: v for k, v in body.items() if k not in skip}

    async def _publish(self, res: kmock.resource, etype: str, body: Mapping[str, Any]) -> None:
        event = {"type": etype, "object": copy.deepcopy(dict(body))}
        self._history.append((int(body["metadata"]["resourceVersion"]), res, event))
        while len(self._history) > self.history_limit:
            self._compacted = self._history.popleft()[0]
        await self._buses[res].put(event)

    @staticmethod
    def _matches(request: kmock.Request, body: Mapping[str, Any]) -> bool:
        meta = body.get("metadata") or {}
        return (request.namespace is None or meta.get("namespace") == request.namespace) and (
            request.name is None or meta.get("name") == request.name
        )

    # -- state changes -----------------------------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        mutation = request.resource is not None and (
            request.action in _MUTATIONS or (request.method == kmock.method.PUT and request.name is not None)
        )
        if not mutation:
            return await kmock.RawHandler._handle(self, request)
        async with self._lock:
            if request.action == kmock.action.CREATE:
                result = await self._create(request)
            elif request.name is None:
                raise _error(405, "MethodNotAllowed", "collection-wide updates and deletions are not emulated")
            elif request.action == kmock.action.DELETE:
                result = await self._delete(request)
            else:
                result = await self._update(request)
        self._results[request.id] = result
        try:
            return await kmock.RawHandler._handle(self, request)  # user reactions first, then the fallbacks
        finally:
            self._results.pop(request.id, None)

    async def _create(self, request: kmock.Request) -> dict[str, Any]:
        res = request.resource
        info = self._info(res)
        assert res is not None
        if not isinstance(request.data, Mapping):
            raise _error(400, "BadRequest", "the body must be a JSON object")
        body: dict[str, Any] = copy.deepcopy(dict(request.data))
        meta = body.setdefault("metadata", {})
        namespace = (request.namespace or meta.get("namespace")) if info.namespaced else None
        if info.namespaced and not namespace:
            raise _error(400, "BadRequest", "a namespaced object needs a namespace")
        if meta.get("namespace") and namespace and meta["namespace"] != namespace:
            raise _error(400, "BadRequest", "the namespace of the body does not match that of the URL")
        name = meta.get("name") or (
            meta["generateName"] + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
            if meta.get("generateName")
            else None
        )
        if not name:
            raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
        key = (res, namespace, name)
        if self._live(key) is not None:
            raise _error(409, "AlreadyExists", f"{res.plural} {name!r} already exists")
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion", "uid"):
            meta.pop(field, None)
        meta.update(
            name=name,
            uid=str(uuid.uuid4()),
            creationTimestamp=now_rfc3339(),
            generation=1,
            resourceVersion=self._next_version(),
        )
        if namespace:
            meta["namespace"] = namespace
        body.setdefault("apiVersion", api_version(res))
        body.setdefault("kind", info.kind)
        if self._has_status_subresource(res):
            body.pop("status", None)
            if res == POD_RESOURCE:
                body["status"] = {"phase": "Pending"}
        apply_schema_defaults(body, self._schemas.get(res))
        if key in self.objects:
            self.objects[key].create(body)
        else:
            self.objects[key] = body
        if res == CRD_RESOURCE:
            self.declare_crd(body)
        await self._publish(res, "ADDED", body)
        return body

    async def _update(self, request: kmock.Request) -> dict[str, Any]:
        res = request.resource
        assert res is not None and request.name is not None
        info = self._info(res)
        obj = self._live((res, request.namespace if info.namespaced else None, request.name))
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        old: dict[str, Any] = copy.deepcopy(obj.raw)
        if request.subresource not in (None, "status"):
            raise _error(404, "NotFound", f"subresource {request.subresource!r} is not emulated")
        split = self._has_status_subresource(res)
        on_status = request.subresource == "status"
        if request.method == kmock.method.PUT:
            new = self._replaced(old, request, split=split, on_status=on_status)
        else:
            new = self._patched(old, request, split=split, on_status=on_status)
        new_meta = new.setdefault("metadata", {})
        for field in _IMMUTABLE_META:
            if field in old["metadata"]:
                new_meta[field] = old["metadata"][field]
            else:
                new_meta.pop(field, None)
        if old["metadata"].get("deletionTimestamp") and set(new_meta.get("finalizers") or ()) - set(
            old["metadata"].get("finalizers") or ()
        ):
            raise _error(422, "Invalid", "Forbidden: no new finalizers can be added if the object is being deleted")
        apply_schema_defaults(new, self._schemas.get(res))
        if new == old:
            return old  # a no-op: no new resourceVersion, no event (as on a real server)
        if self._spec_part(res, new) != self._spec_part(res, old):
            new_meta["generation"] = int(old["metadata"].get("generation") or 0) + 1
        new_meta["resourceVersion"] = self._next_version()
        if new_meta.get("deletionTimestamp") and not new_meta.get("finalizers"):
            obj.history.append(new)
            obj.delete()
            await self._publish(res, "DELETED", new)
            self._forget_crd(res, new)
            return new
        obj.history.append(new)
        await self._publish(res, "MODIFIED", new)
        return new

    @staticmethod
    def _patched(old: dict[str, Any], request: kmock.Request, *, split: bool, on_status: bool) -> dict[str, Any]:
        ctype = _header(request, "Content-Type").split(";")[0].strip().lower()
        patch = request.data
        if ctype == "application/json-patch+json":
            if not isinstance(patch, list):
                raise _error(400, "BadRequest", "a JSON patch must be a list of operations")
            if split:
                patch = [
                    op
                    for op in patch
                    if op.get("op") == "test" or (str(op.get("path", "")).startswith("/status") == on_status)
                ]
            try:
                return jsonpatch.apply_patch(old, patch, in_place=False)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                raise _error(422, "Invalid", f"the JSON patch cannot be applied: {e}") from None
        if ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json", "application/json"):
            if not isinstance(patch, Mapping):
                raise _error(400, "BadRequest", "a merge patch must be a JSON object")
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and str(wanted) != old["metadata"].get("resourceVersion"):
                raise _error(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version and try again",
                )
            if split:
                patch = {k: v for k, v in patch.items() if (k == "status") == on_status}
            return merge_patch(old, patch)
        raise _error(415, "UnsupportedMediaType", f"the patch content type {ctype!r} is not emulated")

    @staticmethod
    def _replaced(old: dict[str, Any], request: kmock.Request, *, split: bool, on_status: bool) -> dict[str, Any]:
        if not isinstance(request.data, Mapping):
            raise _error(400, "BadRequest", "the body must be a JSON object")
        new: dict[str, Any] = copy.deepcopy(dict(request.data))
        meta = new.get("metadata") or {}
        if meta.get("name") not in (None, request.name):
            raise _error(400, "BadRequest", "the name of the body does not match that of the URL")
        wanted = meta.get("resourceVersion")
        if wanted is not None and str(wanted) != old["metadata"].get("resourceVersion"):
            raise _error(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if split and on_status:
            return (
                {**old, "status": new.get("status")}
                if "status" in new
                else {k: v for k, v in old.items() if k != "status"}
            )
        if split:
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        return new

    async def _delete(self, request: kmock.Request) -> dict[str, Any]:
        res = request.resource
        assert res is not None and request.name is not None
        info = self._info(res)
        obj = self._live((res, request.namespace if info.namespaced else None, request.name))
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        body: dict[str, Any] = copy.deepcopy(obj.raw)
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return body  # already being deleted: nothing changes
        meta["resourceVersion"] = self._next_version()
        if meta.get("finalizers"):
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = 0
            meta["generation"] = int(meta.get("generation") or 0) + 1
            obj.history.append(body)
            await self._publish(res, "MODIFIED", body)
            return body
        obj.history.append(body)
        obj.delete()
        await self._publish(res, "DELETED", body)
        self._forget_crd(res, body)
        return body

    def _forget_crd(self, res: kmock.resource, body: Mapping[str, Any]) -> None:
        if res == CRD_RESOURCE:
            self._undeclare_crd(body)

    # -- the fallback responses (after any user-defined reaction) ------------------------------------
    async def _serve_create(self, request: kmock.Request) -> kmock.Payload:
        return kmock.Response(status=201, payload=self._results[request.id])

    async def _serve_update(self, request: kmock.Request) -> kmock.Payload:
        return self._results[request.id]

    async def _serve_replace(self, request: kmock.Request) -> kmock.Payload:
        if request.id not in self._results:
            raise kmock.KubernetesEndpointNotFoundError()
        return self._results[request.id]

    async def _serve_delete(self, request: kmock.Request) -> kmock.Payload:
        return self._results[request.id]

    async def _serve_fetch(self, request: kmock.Request) -> kmock.Payload:
        info = self._info(request.resource)
        assert request.resource is not None and request.name is not None
        async with self._lock:
            obj = self._live((request.resource, request.namespace if info.namespaced else None, request.name))
            if obj is None:
                raise kmock.KubernetesObjectNotFoundError()
            return copy.deepcopy(obj.raw)

    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        res = request.resource
        info = self._info(res)
        assert res is not None
        async with self._lock:
            items = [
                copy.deepcopy(obj.raw)
                for (r, _, _), obj in self.objects.items()
                if r == res and not obj.deleted and self._matches(request, obj.raw)
            ]
            revision = self._revision
        return {
            "apiVersion": api_version(res),
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(revision)},
            "items": items,
        }

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[kmock.Payload]:
        res = request.resource
        self._info(res)
        assert res is not None
        since = request.params.get("resourceVersion") or "0"
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        yield b""  # send the headers now: a watch that sees nothing for a while is still a watch
        async with self._lock:
            bus = self._buses[res]
            mark = await bus.mark()  # under the lock: no event between the replay and the live stream is lost
            if since == "0":
                replay = [
                    {"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                    for (r, _, _), obj in self.objects.items()
                    if r == res and not obj.deleted and self._matches(request, obj.raw)
                ]
            elif not since.isdigit():
                replay = [self._watch_error(400, "BadRequest", f"invalid resourceVersion {since!r}")]
            elif int(since) < self._compacted:
                replay = [self._watch_error(410, "Expired", f"too old resource version: {since}")]
            else:
                replay = [
                    copy.deepcopy(event)
                    for rv, r, event in self._history
                    if r == res and rv > int(since) and self._matches(request, event["object"])
                ]
        try:
            for event in replay:
                yield event
            if replay and replay[-1]["type"] == "ERROR":
                return
            deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
            stream = bus.stream(since=mark)
            try:
                while True:
                    remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
                    if remaining is not None and remaining <= 0:
                        return
                    try:
                        event = await asyncio.wait_for(anext(stream), remaining)
                    except TimeoutError:
                        return
                    if self._matches(request, event["object"]):
                        yield copy.deepcopy(event)
            finally:
                await stream.aclose()
        finally:
            await bus.unmark(mark)

    @staticmethod
    def _watch_error(code: int, reason: str, message: str) -> dict[str, Any]:
        return {
            "type": "ERROR",
            "object": {
                "apiVersion": "v1",
                "kind": "Status",
                "metadata": {},
                "status": "Failure",
                "code": code,
                "reason": reason,
                "message": message,
            },
        }


def load_crds(path: str | Path) -> list[dict[str, Any]]:
    """The CustomResourceDefinitions in a (multi-document) YAML file."""
    docs = yaml.safe_load_all(Path(path).read_text())
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "CustomResourceDefinition"]


def write_kubeconfig(
    path: str | Path, server: str, *, namespace: str = "default", token: str = "kmock-test-token"
) -> Path:
    """A kubeconfig with one context for ``server`` (plain HTTP, bearer token)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": {"token": token}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}],
        "current-context": "kmock",
    }
    path = Path(path)
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    path.chmod(0o600)
    return path


class EmulatorServer:
    """One ``KubernetesEmulator`` served over HTTP on ``host`` (loopback) from a background thread.

    Use as a context manager or with ``start()``/``stop()``.  ``call(fn)`` runs ``fn(emulator)`` in the
    server's event loop (the emulator is not thread-safe) and returns its result.
    """

    def __init__(
        self,
        emulator: KubernetesEmulator | None = None,
        *,
        host: str = "127.0.0.1",
        crds: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        if not host.startswith("127."):
            raise ValueError("the emulator listens on loopback only")
        self.emulator = emulator if emulator is not None else KubernetesEmulator()  # an empty one is falsy
        self.host = host
        self.port = 0
        self._crds = [dict(c) for c in crds]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> EmulatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 10.0) -> EmulatorServer:
        self._thread = threading.Thread(target=self._main, name="kmock-emulator", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"the Kubernetes emulator did not start within {timeout}s")
        if self._failure is not None:
            raise RuntimeError("the Kubernetes emulator failed to start") from self._failure
        for crd in self._crds:  # through the API, so they get versions and events like any object
            self.call_async(lambda emu, crd=crd: emu.install_crd(crd))
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopping is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def call(self, fn: Callable[[KubernetesEmulator], T], timeout: float = 10.0) -> T:
        """Run ``fn(emulator)`` in the server's loop (for reads of ``emulator.objects`` and ``.requests``)."""

        async def run() -> T:
            return fn(self.emulator)

        return self._submit(run(), timeout)

    def call_async(self, fn: Callable[[KubernetesEmulator], Any], timeout: float = 10.0) -> Any:
        return self._submit(fn(self.emulator), timeout)

    def _submit(self, coro: Any, timeout: float) -> Any:
        assert self._loop is not None, "the emulator is not running"
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        return write_kubeconfig(path, self.url, namespace=namespace)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported to start() if it happens before the server is up
            self._failure = e
            self._started.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        async with self.emulator:
            server = aiohttp.web.Server(self.emulator, handler_cancellation=True)
            runner = aiohttp.web.ServerRunner(server, shutdown_timeout=1.0)
            await runner.setup()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            self.port = sock.getsockname()[1]
            site = aiohttp.web.SockSite(runner, sock)
            try:
                await site.start()
                self._started.set()
                await self._stopping.wait()
            finally:
                await runner.cleanup()
