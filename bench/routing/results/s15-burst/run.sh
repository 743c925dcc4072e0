#!/bin/sh
# Session 15: requests held behind a burst's first prefill count as one for the load gate of a request that joins
# them (Worker.held, 2219d19) against the session's start (23da55e).  Fleets 0 2 6 8, load 0.8, bursty and
# shared_prefix, 1 and 4 replicas with and without peers.  (The run used a stash commit of the working tree whose
# router code is 2219d19's but for one docstring.)  Run from the repository root.
set -e
out=bench/routing/results/s15-burst
for f in ${FLEETS:-0 2 6 8}; do
  for arm in ${ARMS:-base:23da55e new:2219d19}; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload bursty,shared_prefix --targets smg:cache_aware+peers,smg:cache_aware \
      --replicas 1,4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
