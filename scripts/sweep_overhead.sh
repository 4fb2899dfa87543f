#!/bin/bash
# The 12-job sweep of issue 5, twice: as 12 separate commands, then as one sweep
# (which prints its wall time against the sum of its jobs' own).  Run it from an
# environment where composerun is installed; STEPS=N changes the steps per job (5).
set -u
work=$(mktemp -d) && cd "$work" || exit 1
t0=$(date +%s.%N)
for m in composite composite_param; do for mesh in 1 2 2x2; do for p in fsdp hsdp; do
  composerun +model=$m mesh=$mesh sharding=$p train.steps=${STEPS:-5} hydra.run.dir=run_${m}_${mesh}_${p} \
    metrics.progress=false > /dev/null 2>&1
done; done; done
t1=$(date +%s.%N)
echo "12 separate commands: $(echo "$t1 - $t0" | bc) s"
t0=$(date +%s.%N)
composerun -m +model=composite,composite_param mesh=1,2,2x2 sharding=fsdp,hsdp train.steps=${STEPS:-5} \
  hydra.sweep.dir=sweep 2>&1 | grep "composerun: sweep"
t1=$(date +%s.%N)
echo "the sweep command: $(echo "$t1 - $t0" | bc) s; runs in $work"
