#!/bin/bash
# The matrix at fcb5eef (session 18: turns claimed across replicas, replicas in sync from their start), run from the repository root (router of that commit).
set -e
out=bench/routing/results/s18-matrix
rev=${REV:-fcb5eef}
.venv/bin/python bench/routing/run.py --workload shared_prefix \
  --targets smg:cache_aware+peers,smg:cache_aware,smg:least_load,smg:round_robin,rust:cache_aware,rust:round_robin \
  --replicas 1,2,4,8 --loads 0.6,0.8,0.95 --router-arg=--tree-chars-per-token=1 --router-commit $rev \
  --out $out/shared_prefix.json --plots $out
.venv/bin/python bench/routing/run.py --workload multi_turn,bursty,long,unique \
  --targets smg:cache_aware+peers,smg:cache_aware,smg:round_robin,rust:cache_aware,rust:round_robin --replicas 1,4 \
  --loads 0.8 --router-arg=--tree-chars-per-token=1 --router-commit $rev --out $out/others.json --plots $out
