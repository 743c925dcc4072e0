#!/bin/sh
# Session 14: a burst on a new prefix waits for its first prefill (attempt.Holds, 6f4aba3) against the router before
# it (7bd5576, which has the session's cheaper rendezvous score already).  Fleets 0 2 6 8, load 0.8, 1 replica and 4
# with peers; round_robin once per fleet, in NEW's run.  Run from the repository root.
set -e
out=bench/routing/results/s14-hold
for f in ${FLEETS:-0 2 6 8}; do
  for arm in ${ARMS:-base:7bd5576 new:6f4aba3}; do
    name=${arm%%:*}; rev=${arm#*:}
    targets=smg:cache_aware+peers
    [ $name = new ] && targets=$targets,smg:round_robin
    .venv/bin/python bench/routing/run.py --workload ${WORKLOADS:-bursty,shared_prefix,unique,multi_turn} \
      --targets $targets --replicas 1,4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
