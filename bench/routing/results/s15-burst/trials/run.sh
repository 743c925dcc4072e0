#!/bin/sh
# shared_prefix with 4 replicas and peers on fleet 2, 7 interleaved trials per arm (the cell that moved most in
# ../run.sh).  Run from the repository root.
set -e
out=bench/routing/results/s15-burst/trials
for t in 1 2 3 4 5 6 7; do
  for arm in base:23da55e new:2219d19; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload shared_prefix --targets smg:cache_aware+peers \
      --replicas 4 --loads 0.8 --seed 1 --fleet-seed 2 --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/trial-$name-$t.json
  done
done
