#!/bin/sh
# Session 16 trial: streamed requests on the same leading chars that have not started their answer count as one for
# the load gate of a request that joins them (Worker.joining; the working tree 87b1583, a stash commit) against b2ed74c.
# Fleets 0 2 6 8, load 0.8, 1 replica and 4 with peers.  Run from the repository root.
set -e
out=${OUT:-bench/routing/results/s16-join}
for f in ${FLEETS:-0 2 6 8}; do
  for arm in ${ARMS:-base:b2ed74c join:87b1583}; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload bursty,shared_prefix,multi_turn,unique --targets smg:cache_aware+peers \
      --replicas 1,4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
