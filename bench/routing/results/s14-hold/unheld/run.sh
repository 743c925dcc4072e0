#!/bin/sh
# Session 14 trial: held requests not counted in their worker's load (362a547, an experiment commit off main)
# against 6f4aba3 (they count).  Fleets 0 2 6 8, load 0.8, 1 replica and 4 with peers.  Run from the repository root.
set -e
out=bench/routing/results/s14-hold/unheld
for f in 0 2 6 8; do
  for arm in held:6f4aba3 unheld:362a547; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload bursty,shared_prefix --targets smg:cache_aware+peers \
      --replicas 1,4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
