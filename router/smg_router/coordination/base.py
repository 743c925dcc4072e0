"""The other router replicas as the request path sees them: ``Peers`` (``transport.PeerSync`` behind it) and
``NoPeers`` (a router alone).  ``Holds`` tells them its leads through it; ``Attempts`` tells them its routes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Peers(Protocol):
    """The other router replicas, as the request path sees them (``transport.PeerSync``): told what this one routed and
    which first prefills its requests lead."""

    id: str
    """This router's id in what it tells (the peers' ids order their claims on a first prefill: ``Holds``)."""

    def tell(self, role: str, model: str, worker_url: str, text: str, head: int) -> None:
        """This router sent ``text`` (its head ``head`` chars) of ``model`` to the worker: tell every peer."""
        ...

    def tell_prefill(self, worker_url: str, prefix: str, *, done: bool, hurry: bool = False) -> None:
        """A request of this router brought ``prefix`` (its leading chars) to the worker and leads its first prefill
        there (``done`` False), or that prefill ended (``done`` True): tell every peer (``Holds``; ``hurry``:
        without the batch delay)."""
        ...

    def claim(self, worker_url: str, prefix: str, answered: Callable[[list[str]], None]) -> None:
        """As ``tell_prefill`` of a start; ``answered`` is called once every peer answered the batch that carried
        it, with the ids of those that lead a prefill of the same prefix on the same worker themselves (``Holds``)."""
        ...

    def in_sync(self) -> bool:
        """Whether there are peers and every one acknowledged what it was told lately."""
        ...


class NoPeers:
    """A router with no peers configured: nobody to tell, never in sync."""

    id = ""

    def tell(self, role: str, model: str, worker_url: str, text: str, head: int) -> None:
        pass

    def tell_prefill(self, worker_url: str, prefix: str, *, done: bool, hurry: bool = False) -> None:
        pass

    def claim(self, worker_url: str, prefix: str, answered: Callable[[list[str]], None]) -> None:
        answered([])

    def in_sync(self) -> bool:
        return False


NO_PEERS: Peers = NoPeers()
