#!/bin/bash
# W1 FP8 on the meta device, cold then warm twice (second and third processes, --kb), alternated: f942e3e (before) and aa0bccc (after).
cd "$(git rev-parse --show-toplevel)"  # dev/old: git archive f942e3e kopt benchmarks | tar -x -C dev/old
echo "# python -m benchmarks.probes.optimize_time --model qwen-image --fp8 --kb PATH (cold, then warm twice), alternated: f942e3e (before) and the lazy captured module with its fingerprint from the traced block (after); 2-core CPU"
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then tree=dev/old; else tree=.; fi
    rm -f /tmp/ab/$side.kb
    for run in cold warm warm; do
      echo "$side $run:"
      (cd $tree && python -m benchmarks.probes.optimize_time --model qwen-image --fp8 --kb /tmp/ab/$side.kb 2>&1 | grep "^qwen-image: capture\|warm start")
    done
  done
done
