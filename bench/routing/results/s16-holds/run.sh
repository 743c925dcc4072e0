#!/bin/sh
# Session 16: replicas tell their peers the first prefills their requests lead, and hold their own requests behind
# the peers' (attempt.Holds.observe; the working tree dbf4c2e, committed as the next commit) against e1669a9.
# Fleets 0 2 6 8, load 0.8, bursty and shared_prefix, 4 replicas with peers.  Run from the repository root.
set -e
out=bench/routing/results/s16-holds
for f in ${FLEETS:-0 2 6 8}; do
  for arm in ${ARMS:-base:e1669a9 new:dbf4c2e}; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload bursty,shared_prefix --targets smg:cache_aware+peers \
      --replicas 4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
