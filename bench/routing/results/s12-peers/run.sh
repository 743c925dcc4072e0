#!/bin/sh
# Session 12: replicas that tell each other their routes (smg:cache_aware+peers) against the same replicas without
# (smg:cache_aware), shared_prefix at load 0.8 over the six fleet seeds of sessions 8-11, then the other workloads
# at 4 replicas on fleets 0 and 2.  Run from the repository root.
set -e
out=bench/routing/results/s12-peers
for f in 0 2 6 8 9 13; do
  .venv/bin/python bench/routing/run.py --workload shared_prefix --targets smg:cache_aware,smg:cache_aware+peers \
    --replicas 2,4,8 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 --out $out/sp-f$f.json
done
for f in 0 2; do
  .venv/bin/python bench/routing/run.py --workload multi_turn,bursty,unique,long \
    --targets smg:cache_aware,smg:cache_aware+peers --replicas 4 --loads 0.8 --seed 1 --fleet-seed $f \
    --router-arg=--tree-chars-per-token=1 --out $out/w-f$f.json
done
