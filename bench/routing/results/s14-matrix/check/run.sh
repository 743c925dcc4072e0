#!/bin/sh
# Session 14: long and multi_turn with 4 replicas read lower in the matrix at 6f4aba3 than at b77e9ef.  Which
# commit: the session's start (288579d), the new rendezvous score (7bd5576), the hold (6f4aba3)?  Fleets 0 2 6 8,
# load 0.8, with and without peers.  Run from the repository root.
set -e
out=bench/routing/results/s14-matrix/check
for f in 0 2 6 8; do
  for arm in start:288579d hash:7bd5576 hold:6f4aba3; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload long,multi_turn --targets smg:cache_aware+peers,smg:cache_aware \
      --replicas 4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
