#!/bin/bash
# W1 FP8 cold, alternating this tree and the previous commit (dev/old4), fresh KB and Triton cache each.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1; ROOT=$PWD
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
for run in new_a old_b new_c; do
  rm -rf /tmp/r.kb /tmp/tc_$run
  dir=$PWD; [ "${run#old}" != "$run" ] && dir=$PWD/dev/old4
  (cd $dir && TRITON_CACHE_DIR=/tmp/tc_$run PYTHONPATH=/tmp/site:$dir timeout 100 python $ROOT/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r.kb > $OUT/w1_cold_$run.txt 2>&1; echo "rc $?" >> $OUT/w1_cold_$run.txt)
  echo "== $run"; grep "^qwen-image: capture\|^rc" $OUT/w1_cold_$run.txt | cut -c1-120
done
