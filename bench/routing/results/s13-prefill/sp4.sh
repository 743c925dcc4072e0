#!/bin/sh
# shared_prefix, 4 replicas with peers, the six fleets of sessions 8-12, BASE (3adc6f1) and NEW (b77e9ef) in turn:
# the 4-replica cells of run.sh moved 0.77-0.88 between runs.  Run from the repository root.
set -e
for f in 0 2 6 8 9 13; do
  for arm in base:3adc6f1 new:b77e9ef; do
    .venv/bin/python bench/routing/run.py --workload shared_prefix --targets smg:cache_aware+peers --replicas 4 \
      --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 --router-commit ${arm#*:} \
      --out bench/routing/results/s13-prefill/sp4-${arm%%:*}-f$f.json
  done
done
