"""The worker registry: every registered worker by id and by URL.  Mutated only by ``lifecycle``."""

from __future__ import annotations

from collections.abc import Iterator

from smg_router.workers.worker import Worker


class WorkerRegistry:
    __slots__ = ("_by_id", "_by_url")

    def __init__(self) -> None:
        self._by_id: dict[str, Worker] = {}
        self._by_url: dict[str, Worker] = {}

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

    def discard(self, worker: Worker) -> None:
        self._by_id.pop(worker.id, None)
        self._by_url.pop(worker.url, None)

    def with_role(self, role: str) -> list[Worker]:
        return [w for w in self._by_id.values() if w.role == role]

    def serving(self, role: str, model: str | None) -> list[Worker]:
        """Workers of a role that serve ``model`` (a worker of unknown model serves any)."""
        return [
            w
            for w in self._by_id.values()
            if w.role == role and (model is None or w.model_id is None or w.model_id == model)
        ]

    def models(self) -> set[str]:
        return {w.model_id for w in self._by_id.values() if w.model_id is not None}
