#!/bin/sh
# Session 17 trials against e0ebba4, fleets 0 2 6 8, load 0.8, 1 replica and 4 with peers.  Run from the repository
# root.  Arms: claim (the working tree as stash commit 28e8a29: a replica in sync claims a lead for a fixed 15 ms
# and yields to a lower id's lead of the same prefix on the same worker); claim2 (stash commit 1cd6367, the router
# code of the session's commit: the claim waits for every peer's answer, at most 50 ms, and yields to a peer that
# leads the same); claim3 (stash commit b4e42af: claim2, plus only a lead whose worker is to prefill at least 1024
# chars claims it, and only claimed starts skip the batch delay: two holds timed out on fleet 0, a claim yielded, by
# the answer, to a lead whose start and end then cancelled out in the leader's queue); claim4 (283b17a: an end
# replaces its start not yet sent).  Stash commits live in the checkout that ran it only.
set -e
out=${OUT:-bench/routing/results/s17-claim}
for f in ${FLEETS:-0 2 6 8}; do
  for arm in ${ARMS:-base:e0ebba4 claim:28e8a29 claim2:1cd6367 claim3:b4e42af claim4:283b17a}; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload bursty,shared_prefix,multi_turn,unique --targets smg:cache_aware+peers \
      --replicas 1,4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
