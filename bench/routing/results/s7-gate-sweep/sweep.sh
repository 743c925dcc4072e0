cd /work/main
for w in shared_prefix bursty unique; do for t in 4 8 16; do for f in 0 1 2; do
  timeout 600 .venv/bin/python bench/routing/run.py --workload $w --targets smg:cache_aware --replicas 1,4 --loads 0.8 --seed 1 --fleet-seed $f --router-arg=--tree-chars-per-token=1 --router-arg=--balance-abs-threshold=$t --out bench/routing/results/s7-gate-sweep/sw-$w-abs$t-f$f.json 2>&1 | grep -E "^\| $w \| smg|fleet:" | sed "s/^/abs=$t f=$f /"
done; done; done
