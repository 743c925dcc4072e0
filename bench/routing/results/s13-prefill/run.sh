#!/bin/sh
# Session 13: a new prompt goes where its prefill waits least (Worker.prefill_chars, policies.base.prefill_wait):
# NEW (b77e9ef) against the router before it, BASE (3adc6f1), both with the sim of b77e9ef (a chat stream names its
# role with the first output, after the prefill, as SGLang does).  Four fleets, load 0.8, 1 replica and 4 with peers;
# round_robin once per fleet, in NEW's run.  Run from the repository root.
set -e
out=bench/routing/results/s13-prefill
for f in 0 2 6 8; do
  for arm in ${ARMS:-base:3adc6f1 new:b77e9ef}; do
    name=${arm%%:*}; rev=${arm#*:}
    targets=smg:cache_aware+peers
    [ $name = new ] && targets=$targets,smg:round_robin
    .venv/bin/python bench/routing/run.py --workload shared_prefix,unique,bursty,multi_turn --targets $targets \
      --replicas 1,4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
