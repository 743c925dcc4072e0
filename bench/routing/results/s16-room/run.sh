#!/bin/sh
# Session 16: how replicas in sync with their peers place a miss.  Arms: the session's start (base, 20f680d); room
# before their own prefills (room, e314d07, a stash commit of the working tree, not kept); room, then the fewest
# prompts of the new one's size held, then the prefills (fill, 7203458, floor division: a share a char short of one
# prompt counted none; fill2, 5d1b50d, rounded: what was committed).  Fleets 0 2 6 8, load 0.8, 4 replicas with peers;
# long was the cell the hash draw hurt (session 14).  Run from the repository root, e.g. ARMS="fill2:5d1b50d".
set -e
out=bench/routing/results/s16-room
for f in ${FLEETS:-0 2 6 8}; do
  for arm in ${ARMS:-base:20f680d room:e314d07 fill:7203458 fill2:5d1b50d}; do
    name=${arm%%:*}; rev=${arm#*:}
    .venv/bin/python bench/routing/run.py --workload long,shared_prefix,multi_turn,unique --targets smg:cache_aware+peers \
      --replicas 4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 \
      --router-commit $rev --out $out/$name-f$f.json
  done
done
