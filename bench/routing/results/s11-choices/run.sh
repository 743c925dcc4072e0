#!/bin/sh
# Session 11: --placement-choices 2 (the default) vs 4 (every worker of the 4) on shared_prefix, 1 replica (the
# room rule is off for one of several replicas), six fleet seeds.  Run from the repository root.
set -e
out=bench/routing/results/s11-choices
for f in 0 2 6 8 9 13; do
  for c in 2 4; do
    .venv/bin/python bench/routing/run.py --workload shared_prefix --targets smg:cache_aware --replicas 1 \
      --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 --router-arg=--placement-choices=$c \
      --out $out/c$c-f$f.json
  done
done
# the other workloads, 1 replica, fleets 0 and 2
for f in 0 2; do
  for c in 2 4; do
    .venv/bin/python bench/routing/run.py --workload multi_turn,bursty,unique,long --targets smg:cache_aware --replicas 1 \
      --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 --router-arg=--placement-choices=$c \
      --out $out/w-c$c-f$f.json
  done
done
# 2, 4 and 8 replicas at the new default (64907b6), the same six fleets
for f in 0 2 6 8 9 13; do
  .venv/bin/python bench/routing/run.py --workload shared_prefix --targets smg:cache_aware --replicas 2,4,8 \
    --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 --out $out/multi-f$f.json
done
# the lone router's slack (slack/): the trial ran as an environment switch of the working tree
# (SMG_TRIAL_SLACK=1, the rule that became ALONE_SLACK in the next commit), same commands as above with
# the new default, 1 replica: shared_prefix over the six fleets (slack/s-fF.json), the other workloads on
# fleets 0 and 2 (slack/w-fF.json)
