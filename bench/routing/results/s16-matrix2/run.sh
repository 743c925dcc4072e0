#!/bin/bash
# The matrix at d00ca84 (session 16, after the bursts that join, 0238698), run from the repository root.
set -e
out=bench/routing/results/s16-matrix2
.venv/bin/python bench/routing/run.py --workload shared_prefix \
  --targets smg:cache_aware+peers,smg:cache_aware,smg:least_load,smg:round_robin,rust:cache_aware,rust:round_robin \
  --replicas 1,2,4,8 --loads 0.6,0.8,0.95 --router-arg=--tree-chars-per-token=1 \
  --out $out/shared_prefix.json --plots $out
.venv/bin/python bench/routing/run.py --workload multi_turn,bursty,long,unique \
  --targets smg:cache_aware+peers,smg:cache_aware,smg:round_robin,rust:cache_aware,rust:round_robin --replicas 1,4 \
  --loads 0.8 --router-arg=--tree-chars-per-token=1 --out $out/others.json --plots $out
