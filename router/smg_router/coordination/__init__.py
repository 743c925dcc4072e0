"""coordination: what router replicas tell each other, one protocol.  Below the request path, above the policies
(which never import it: sync calls the policy, never the reverse).

What it does.  A replica behind a Service sends 1/N of the traffic, so its own tree knows about 1/N of what the
engines cache: enough to agree with the others on where a new prefix goes (rendezvous placement needs no state), not
enough to judge whether a worker has KV room left for one more.  So every replica tells every other one what it
routed (``transport.PeerSync.tell``), and the receiver inserts it as if it had routed it (``Policy.observe``).  And a
burst on a new prefix is prefilled once, not once a request nor once a replica: the first streamed request leads,
the others wait for its first chunk (``holds.Holds``); the replicas tell each other their leads and their ends, and a
replica in sync with its peers claims a lead before it goes (the lower router id wins two claims that cross).  All
of it is one admin call, ``POST /peers/routes``, whose bodies are ``messages``'s, taken only from the peers'
addresses and, with ``--peer-secret``, signed both ways (``auth``; ``receiver``).  The state table of one (worker,
prefix) on one replica is in docs/architecture.md, "Cache-aware decisions with several replicas".

What it does not guarantee.  There is no lock between the replicas and no consensus: a route is a hint, dropped and
never retried when its batch fails, so a replica's tree may miss what a silent peer sent.  Two replicas out of sync
(a peer silent past ``transport.STALE``), or whose claims go unanswered within ``--prefill-claim-seconds``, may both
lead the same prefill; a lead that fails before its first chunk releases its burst, which then prefills side by side.
A hold never outlasts ``--prefill-hold-seconds`` (then the request goes whatever the lead does), and a peer's lead
is dropped once that peer is silent for ``holds.PEER_SILENCE``.  The processes of one pod (``--processes``) do not
share their holds.
"""

from smg_router.coordination.base import NO_PEERS, NoPeers, Peers
from smg_router.coordination.holds import PEER_SILENCE, Held, Holds
from smg_router.coordination.receiver import Receiver
from smg_router.coordination.transport import PeerSync

__all__ = ["NO_PEERS", "PEER_SILENCE", "Held", "Holds", "NoPeers", "PeerSync", "Peers", "Receiver"]
