#!/bin/sh
# shared_prefix, one router, loads 0.6 and 0.95 (the matrix's 1-replica cells fell from 0.878/0.846 to 0.846/0.797),
# BASE (3adc6f1) and NEW (b77e9ef) in turn on four fleets.  Run from the repository root.
set -e
for f in 0 2 6 8; do
  for arm in base:3adc6f1 new:b77e9ef; do
    .venv/bin/python bench/routing/run.py --workload shared_prefix --targets smg:cache_aware --replicas 1 \
      --loads 0.6,0.95 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 --router-commit ${arm#*:} \
      --out bench/routing/results/s13-prefill/sp1-${arm%%:*}-f$f.json
  done
done
