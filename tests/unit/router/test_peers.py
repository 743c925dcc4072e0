"""What a replica queues for its peers (``peers.PeerSync``): the first prefills its requests lead, and their ends."""

from __future__ import annotations

from smg_router.metrics import Metrics
from smg_router.peers import PeerSync, _Peer

W = "http://127.0.0.2:8000"


def _sync() -> tuple[PeerSync, _Peer]:
    sync = PeerSync(urls=[], dns=None, admin_key=None, metrics=Metrics())
    peer = sync._peers["http://127.0.0.1:9"] = _Peer("http://127.0.0.1:9")
    return sync, peer


def test_a_prefill_that_ends_before_its_start_went_out_is_not_told_at_all() -> None:
    sync, peer = _sync()
    sync.tell_prefill(W, "doc A", done=False)
    sync.tell_prefill(W, "doc B", done=False)
    sync.tell_prefill(W, "doc A", done=True)  # before the batch: doc A's start is taken back, its end not queued
    assert list(peer.prefills.items()) == [((W, "doc B"), False)]
    peer.prefills.clear()  # the batch went out with doc B's start
    sync.tell_prefill(W, "doc B", done=True)
    assert list(peer.prefills.items()) == [((W, "doc B"), True)]  # its start was told: so is its end
    sync.tell_prefill(W, "doc B", done=False)  # a new lead before that end went out: the peer's lead goes on
    assert not peer.prefills


def test_a_peer_that_is_this_router_is_told_nothing_and_a_prefix_too_long_for_a_batch_is_not_told() -> None:
    sync, peer = _sync()
    peer.is_self = True
    sync.tell_prefill(W, "doc A", done=False)
    assert not peer.prefills
    peer.is_self = False
    sync.tell_prefill(W, "x" * (sync._batch_chars + 1), done=False)  # cut, it would name another prefix
    assert not peer.prefills
