"""One memory budget (``--tree-memory-budget``) for the approximate trees and the indexes of the engines' KV events:
each grows into the room the others leave; past it, each is cut in proportion to what it holds."""

from __future__ import annotations

from smg_router.core import RouterCore, run_tree_upkeep
from smg_router.settings import parse_settings
from smg_router.tree import share_budget
from support.policy_env import RouteRequest, make_worker

BUDGET = 4 * 2**20


def test_what_fits_may_grow_into_the_free_room_and_what_does_not_is_cut_in_proportion() -> None:
    assert share_budget(100, [30, 20]) == [80, 70]
    assert share_budget(100, [0, 0]) == [100, 100]
    assert share_budget(100, [150, 50]) == [75, 25]
    assert share_budget(100, [200]) == [100]


async def test_the_trees_and_the_event_indexes_together_stay_within_one_budget() -> None:
    core = RouterCore(parse_settings(["--tree-memory-budget", str(BUDGET), "--model-id", "m"]))
    tree_worker, event_worker = make_worker(2), make_worker(3)
    policy = core.policies.policy_for("regular", "m")
    policy.sync([tree_worker])
    for i in range(1500):  # about 3 MiB of tree
        policy.decide([tree_worker], RouteRequest("m", f"{i:05} a prompt of its own " * 40), 0.0)
    core.events.publishes(event_worker.url, "m")
    blocks = core.events.blocks("m")
    for i in range(200):  # about 3 MiB of blocks, stored within the index's own budget (the whole one)
        tokens = [i, *range(1, 16 * 100)]
        blocks.stored(event_worker.url, hashes=[(i, b) for b in range(100)], parent=None, tokens=tokens, block_size=16)

    def held() -> tuple[int, int]:
        return sum(n for *_, n in core.policies.tree_bytes()), blocks.estimated_bytes()

    trees, events = held()
    assert trees > BUDGET // 2 and events > BUDGET // 2, (trees, events)
    core.share_memory()
    await run_tree_upkeep(core.policies)
    trees_after, events_after = held()
    assert trees_after + events_after <= BUDGET, (trees_after, events_after)
    # each kept about its share: cut in proportion, neither one given up for the other
    share = trees / (trees + events)
    assert abs(trees_after / (trees_after + events_after) - share) < 0.15, (trees, events, trees_after, events_after)
