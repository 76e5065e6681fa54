#!/bin/bash
# W1 FP8 on the meta device, cold then warm twice (second and third processes, --kb), alternated: HEAD before (dev/old3) and this tree (after).
cd "$(git rev-parse --show-toplevel)"  # dev/old3: git archive e2f2468 kopt benchmarks | tar -x -C dev/old3
echo "# python -m benchmarks.probes.optimize_time --model qwen-image --fp8 --kb PATH (cold, then warm twice), alternated: e2f2468 (before) and the capture made when first read (after); 2-core CPU"
mkdir -p /tmp/ab
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then tree=dev/old3; else tree=.; fi
    rm -f /tmp/ab/$side.kb
    for run in cold warm warm; do
      echo "$side $run:"
      (cd $tree && /work/main/.venv/bin/python -m benchmarks.probes.optimize_time --model qwen-image --fp8 --kb /tmp/ab/$side.kb 2>&1 | grep "^qwen-image: capture\|warm start")
    done
  done
done
