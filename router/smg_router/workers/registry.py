"""The worker registry: every registered worker by id and by URL.  Mutated only by ``lifecycle``."""

from __future__ import annotations

from collections.abc import Iterator

from smg_router.workers.worker import Worker, WorkerSpec

_MAX_VIEWS = 256


class WorkerRegistry:
    """Every registered worker, by id and by URL, and the views the request path asks for on every request
    (the workers of a role, of a role and model, the models of a role), built once per change of the fleet
    rather than by a scan per request.  A worker's spec changes only through ``respec``, so the views stay true."""

    __slots__ = ("_by_id", "_by_url", "_models", "_roles", "_serving")

    def __init__(self) -> None:
        self._by_id: dict[str, Worker] = {}
        self._by_url: dict[str, Worker] = {}
        self._roles: dict[str, tuple[Worker, ...]] = {}
        self._serving: dict[tuple[str, str | None], tuple[Worker, ...]] = {}
        self._models: dict[str, frozenset[str | None]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._by_id.values()))

    def get(self, worker_id: str) -> Worker | None:
        return self._by_id.get(worker_id)

    def by_url(self, url: str) -> Worker | None:
        return self._by_url.get(url)

    def add(self, worker: Worker) -> None:
        self._by_id[worker.id] = worker
        self._by_url[worker.url] = worker
        self._changed()

    def discard(self, worker: Worker) -> None:
        self._by_id.pop(worker.id, None)
        self._by_url.pop(worker.url, None)
        self._changed()

    def respec(self, worker: Worker, spec: WorkerSpec) -> None:
        """A registered worker's new spec (its role or model may change what the views hold)."""
        worker.spec = spec
        self._changed()

    def _changed(self) -> None:
        self._roles.clear()
        self._serving.clear()
        self._models.clear()

    def with_role(self, role: str) -> tuple[Worker, ...]:
        view = self._roles.get(role)
        if view is None:
            view = self._roles[role] = tuple(w for w in self._by_id.values() if w.role == role)
        return view

    def serving(self, role: str, model: str | None) -> tuple[Worker, ...]:
        """Workers of a role that serve ``model`` (a worker of unknown model serves any)."""
        view = self._serving.get((role, model))
        if view is None:
            view = tuple(w for w in self.with_role(role) if model is None or w.model_id is None or w.model_id == model)
            if len(self._serving) >= _MAX_VIEWS:
                self._serving.clear()  # models are the fleet's, not the clients', but a bound costs nothing
            self._serving[(role, model)] = view
        return view

    def models_of(self, role: str) -> frozenset[str | None]:
        """The model ids the workers of a role serve (None: a worker whose model is not known yet)."""
        view = self._models.get(role)
        if view is None:
            view = self._models[role] = frozenset(w.model_id for w in self.with_role(role))
        return view

    def models(self) -> set[str]:
        return {w.model_id for w in self._by_id.values() if w.model_id is not None}
