#!/bin/bash
# W1 FP8 on the meta device, cold then warm (a second process, --kb), alternated: ef3397a (before) and this stop's code (after).
cd "$(git rev-parse --show-toplevel)"  # dev/old: git archive ef3397a kopt benchmarks | tar -x -C dev/old
echo "# python -m benchmarks.probes.optimize_time --model qwen-image --fp8 [--kb PATH, twice], alternated: ef3397a (before) and 59ed4c1 (after); 2-core CPU"
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then tree=dev/old; else tree=.; fi
    rm -f /tmp/ab/$side.kb
    for run in cold warm; do
      echo "$side $run:"
      (cd $tree && python -m benchmarks.probes.optimize_time --model qwen-image --fp8 --kb /tmp/ab/$side.kb 2>&1 | grep "^qwen-image: capture\|warm start")
    done
  done
done
