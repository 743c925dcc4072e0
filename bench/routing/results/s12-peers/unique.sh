#!/bin/sh
# unique prompts, 4 replicas, with and without peers, four fleets (the matrix's 4-replica p99 with peers, 2209,
# was over the sweep's); run from the repository root.
set -e
for f in 0 2 6 8; do
  .venv/bin/python bench/routing/run.py --workload unique --targets smg:cache_aware,smg:cache_aware+peers,smg:round_robin \
    --replicas 4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
    --out bench/routing/results/s12-peers/unique-f$f.json
done
