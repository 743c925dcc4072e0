"""What the engines of one model say they cache, block by block: the index their KV events keep.

An engine caches a prompt's KV in blocks of ``block_size`` tokens and says so in events (``BlockStored``: the
blocks' hashes, the parent block's hash, their token ids; ``BlockRemoved``: hashes; ``AllBlocksCleared``).  Its
hashes are its own (seeded, of an algorithm the router does not know), so the index keys a block by a chain of
its own over the token ids instead (a block's key covers its parent's key, so it stands for the whole prefix up
to it), and keeps per worker the map from the engine's hash to that key, for removals and for the next stored
block's parent.  A request's tokens, cut into blocks the same way, are then looked up key by key: a worker holds as
many tokens of the prompt as the consecutive run of its blocks from the first.

The chain starts from the namespace (a LoRA adapter, a cache salt: blocks of different namespaces never match)
and the block size (engines of one model may cut blocks differently).  Keys are Python hashes of int tuples:
the same in every process for the same tokens, and 64 bits, so two prefixes collide about never.

Between a routing decision and the engine's first event for it the engine is still prefilling, so its events say
nothing yet of the prompt: ``speculate`` records the router's own decision for a while (``spec_seconds``), so the
rest of a burst follows the first request.  A speculative entry is this process's alone; ``blocks_of`` (which
placement judges room by, alike on every replica) leaves it out.

Memory: about ``ENTRY_BYTES`` per (worker, block) and ``KEY_BYTES`` per distinct block.  Over ``budget_bytes``
the index forgets the oldest blocks of the worker that has the most: a forgotten block is a miss the engine
would have served from cache, never a hit on a block the engine evicted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

ENTRY_BYTES = 170
"""Estimated bytes of one (worker, block) entry: the engine hash, its key, the dict slot."""
KEY_BYTES = 100
"""Estimated bytes of one distinct block: its key, the holders' bit mask, the dict slot."""


def namespace_of(lora: str | None, salt: str | None) -> str:
    """The namespace of a prompt's blocks: its LoRA adapter and its cache salt, as both the engines' events and the
    requests name them ("" for neither): an engine never shares blocks across them."""
    return f"{lora or ''}\x00{salt or ''}" if lora or salt else ""


def block_keys(tokens: Sequence[int], block_size: int, namespace: str = "", start: int | None = None) -> list[int]:
    """The chained keys of the full blocks of ``tokens``; ``start``: the key of the block before them (none: the
    root of ``namespace`` and ``block_size``)."""
    key = hash((namespace, block_size)) if start is None else start
    keys = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, *tokens[i : i + block_size]))
        keys.append(key)
    return keys


class _Worker:
    __slots__ = ("bit", "block_size", "blocks", "evicted")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.block_size = 0
        """Tokens per block of its engine, from its last stored event (0: none yet)."""
        self.evicted = False
        """Its engine removed blocks since its cache was last empty: an engine evicts only to make room, so its KV
        cache has been full (what it holds now may be less: its running requests hold the rest)."""
        self.blocks: OrderedDict[Hashable, int] = OrderedDict()
        """The engine's block hash -> the index's key, oldest first (an OrderedDict: forgetting the oldest is one
        step, where a dict's first item is found past every slot deleted before it)."""


class BlockIndex:
    """The blocks each worker's engine holds, by the index's chained keys; one per model.

    ``stored``, ``removed`` and ``cleared`` apply a worker's events; ``match`` says how much of a prompt each worker
    holds.  Nothing here is asynchronous: the subscriber applies events as they come, the policy reads between.
    """

    __slots__ = (
        "_expiry",
        "_holders",
        "_spec",
        "_spec_count",
        "_workers",
        "budget_bytes",
        "forgotten",
        "orphans",
        "spec_seconds",
    )

    def __init__(self, *, budget_bytes: int, spec_seconds: float = 10.0) -> None:
        self.budget_bytes = budget_bytes
        self.spec_seconds = spec_seconds
        self._spec: dict[int, int] = {}
        """key -> bit mask of the workers this process sent the block to, before their engines said so"""
        self._expiry: deque[tuple[float, int, int]] = deque()
        """(when, key, bit) of each speculative entry, oldest first"""
        self._spec_count: dict[int, int] = {}
        """bit -> how many speculative blocks the worker has"""
        self._holders: dict[int, int] = {}
        """key -> bit mask of the workers holding that block"""
        self._workers: dict[str, _Worker] = {}
        self.orphans = 0
        """Stored blocks dropped because their parent was not known (an event missed): the worker re-learns them
        when its engine stores them again."""
        self.forgotten = 0
        """Blocks forgotten to stay under the budget."""

    def _worker(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            used = 0
            for other in self._workers.values():
                used |= other.bit
            bit = 1
            while used & bit:
                bit <<= 1
            w = self._workers[worker] = _Worker(bit)
        return w

    def stored(
        self,
        worker: str,
        *,
        hashes: Sequence[Hashable],
        parent: Hashable | None,
        tokens: Sequence[int],
        block_size: int,
        namespace: str = "",
    ) -> int:
        """A ``BlockStored`` event: the blocks ``hashes`` (in order, ``tokens`` their token ids) follow the block
        ``parent`` (None: they start a prompt).  The blocks applied: none when the parent is not known to the index
        or the tokens do not fill the blocks."""
        if block_size <= 0 or len(tokens) < len(hashes) * block_size:
            self.orphans += len(hashes)
            return 0
        w = self._worker(worker)
        w.block_size = block_size
        start = None
        if parent is not None:
            start = w.blocks.get(parent)
            if start is None:
                self.orphans += len(hashes)
                return 0
        keys = block_keys(tokens[: len(hashes) * block_size], block_size, namespace, start)
        holders, spec = self._holders, self._spec
        for engine_hash, key in zip(hashes, keys, strict=True):
            old = w.blocks.pop(engine_hash, None)  # stored again: it is the newest now
            if old is not None and old != key:
                self._drop(old, w.bit)
            w.blocks[engine_hash] = key
            holders[key] = holders.get(key, 0) | w.bit
            if key in spec:  # the engine's word replaces the router's guess
                self._unguess(key, w.bit)
        if self.estimated_bytes() > self.budget_bytes:
            self._shrink()
        return len(keys)

    def removed(self, worker: str, hashes: Sequence[Hashable]) -> int:
        """A ``BlockRemoved`` event; the blocks the index knew (an unknown hash is one it never learned)."""
        w = self._workers.get(worker)
        if w is None:
            return 0
        w.evicted = w.evicted or bool(hashes)
        known = 0
        for engine_hash in hashes:
            key = w.blocks.pop(engine_hash, None)
            if key is not None:
                self._drop(key, w.bit)
                known += 1
        return known

    def cleared(self, worker: str) -> None:
        """An ``AllBlocksCleared`` event, an engine that restarted, or a worker that left: it holds nothing."""
        w = self._workers.pop(worker, None)
        if w is not None:
            for key in w.blocks.values():
                self._drop(key, w.bit)
            for _, key, bit in self._expiry:
                if bit == w.bit:
                    self._unguess(key, bit)  # its bit may go to another worker: nothing of this one may stay

    def _drop(self, key: int, bit: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def speculate(self, worker: str, tokens: Sequence[int], now: float, namespace: str = "") -> None:
        """The prompt ``tokens`` was just sent to ``worker``: count its blocks as held there until its engine's events
        catch up (at most ``spec_seconds``).  Blocks cut as the worker's engine cuts them (16 tokens until it said)."""
        self._expire(now)
        w = self._worker(worker)
        size = w.block_size or 16
        until = now + self.spec_seconds
        for key in block_keys(tokens, size, namespace):
            if not self._holders.get(key, 0) & w.bit:  # what its engine said it holds needs no guess
                mask = self._spec.get(key, 0)
                if not mask & w.bit:
                    self._spec[key] = mask | w.bit
                    self._spec_count[w.bit] = self._spec_count.get(w.bit, 0) + 1
                self._expiry.append((until, key, w.bit))
        if not w.block_size:
            w.block_size = size

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, key, bit = expiry.popleft()
            self._unguess(key, bit)

    def _unguess(self, key: int, bit: int) -> None:
        """The worker's speculative block ``key`` goes (expired, or its engine spoke)."""
        mask = self._spec.get(key, 0)
        if mask & bit:
            if mask & ~bit:
                self._spec[key] = mask & ~bit
            else:
                del self._spec[key]
            self._spec_count[bit] -= 1

    def match(self, tokens: Sequence[int], namespace: str = "", now: float | None = None) -> dict[str, int]:
        """Tokens of the prompt ``tokens`` each worker holds (the consecutive run of its blocks from the first, its
        speculative ones included when ``now`` is given); workers that hold none are left out."""
        if now is not None:
            self._expire(now)
        held: dict[str, int] = {}
        for size in {w.block_size for w in self._workers.values() if w.block_size}:
            held.update(self._match(tokens, size, namespace, now is not None))
        return held

    def _match(self, tokens: Sequence[int], block_size: int, namespace: str, spec: bool) -> dict[str, int]:
        alive = 0
        for w in self._workers.values():
            if w.block_size == block_size:
                alive |= w.bit
        blocks_by_bit: dict[int, int] = {}
        blocks = 0
        holders, speculated = self._holders, self._spec if spec else {}
        for key in block_keys(tokens, block_size, namespace):
            still = alive & (holders.get(key, 0) | speculated.get(key, 0))
            gone = alive & ~still
            if gone and blocks:
                blocks_by_bit.update((bit, blocks) for bit in _bits(gone))
            alive = still
            if not alive:
                break
            blocks += 1
        if alive and blocks:
            blocks_by_bit.update((bit, blocks) for bit in _bits(alive))
        return {name: blocks_by_bit[w.bit] * block_size for name, w in self._workers.items() if w.bit in blocks_by_bit}

    def blocks_of(self, worker: str, *, speculative: bool = False, now: float | None = None) -> int:
        """The blocks the worker's engine said it holds; with ``speculative``, its speculative ones too (as of
        ``now``)."""
        w = self._workers.get(worker)
        if w is None:
            return 0
        if not speculative:
            return len(w.blocks)
        if now is not None:
            self._expire(now)
        return len(w.blocks) + self._spec_count.get(w.bit, 0)

    def full(self, worker: str) -> bool:
        """Whether the worker's engine has evicted since its cache was last empty (``_Worker.evicted``)."""
        w = self._workers.get(worker)
        return w is not None and w.evicted

    def block_size_of(self, worker: str) -> int:
        w = self._workers.get(worker)
        return 0 if w is None else w.block_size

    def workers(self) -> list[str]:
        return list(self._workers)

    def estimated_bytes(self) -> int:
        return KEY_BYTES * len(self._holders) + ENTRY_BYTES * sum(len(w.blocks) for w in self._workers.values())

    def fit(self, budget_bytes: int) -> None:
        """A new budget (it is shared with other indexes): the index is brought under it now if it is over."""
        self.budget_bytes = budget_bytes
        if self.estimated_bytes() > budget_bytes:
            self._shrink()

    def _shrink(self) -> None:
        """Forget the oldest blocks of the worker with the most until the index is 90% of its budget."""
        target = self.budget_bytes * 9 // 10
        while self._workers and self.estimated_bytes() > target:
            w = max(self._workers.values(), key=lambda x: len(x.blocks))
            if not w.blocks:
                return
            for _ in range(max(1, len(w.blocks) // 10)):
                self._drop(w.blocks.popitem(last=False)[1], w.bit)
                self.forgotten += 1


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low)
        mask ^= low
    return out
