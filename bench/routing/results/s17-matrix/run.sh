#!/bin/bash
# The matrix at 92b9cec (session 17, the claims), run from the repository root (router of that commit);
# REV and OUT run it at another commit into another folder (bench/routing/results/s18-matrix/run.sh).
set -e
out=${OUT:-bench/routing/results/s17-matrix}
rev=${REV:-92b9cec}
.venv/bin/python bench/routing/run.py --workload shared_prefix \
  --targets smg:cache_aware+peers,smg:cache_aware,smg:least_load,smg:round_robin,rust:cache_aware,rust:round_robin \
  --replicas 1,2,4,8 --loads 0.6,0.8,0.95 --router-arg=--tree-chars-per-token=1 --router-commit $rev \
  --out $out/shared_prefix.json --plots $out
.venv/bin/python bench/routing/run.py --workload multi_turn,bursty,long,unique \
  --targets smg:cache_aware+peers,smg:cache_aware,smg:round_robin,rust:cache_aware,rust:round_robin --replicas 1,4 \
  --loads 0.8 --router-arg=--tree-chars-per-token=1 --router-commit $rev --out $out/others.json --plots $out
