#!/bin/sh
# Session 14: is shared_prefix with 4 replicas + peers lower with the hold (6f4aba3) than without (7bd5576)?
# Three trials of each arm, fleets 0 and 2, interleaved.  Run from the repository root.
set -e
out=bench/routing/results/s14-hold/trials
for t in 1 2 3; do
  for f in 0 2; do
    for arm in base:7bd5576 new:6f4aba3; do
      name=${arm%%:*}; rev=${arm#*:}
      .venv/bin/python bench/routing/run.py --workload shared_prefix,bursty --targets smg:cache_aware+peers \
        --replicas 4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
        --router-commit $rev --out $out/$name-f$f-t$t.json
    done
  done
done
