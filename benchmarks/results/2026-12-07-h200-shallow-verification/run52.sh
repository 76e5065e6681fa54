#!/bin/bash
# W1 FP8 cold: default (checked on 2 blocks), then --verify-blocks all; warm after the default; GPU tests.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
for run in new_a all_b; do
  rm -rf /tmp/r_$run.kb /tmp/tc_$run
  blocks=2; [ "${run#all}" != "$run" ] && blocks=all
  TRITON_CACHE_DIR=/tmp/tc_$run timeout 100 python dev/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --verify-blocks $blocks --kb /tmp/r_$run.kb > $OUT/w1_cold_$run.txt 2>&1; echo "rc $?" >> $OUT/w1_cold_$run.txt
  echo "== $run"; grep "^qwen-image: \|^rc\|verif\|FAIL\|Error" $OUT/w1_cold_$run.txt | cut -c1-250
done
run=new_a
TRITON_CACHE_DIR=/tmp/tc_$run timeout 70 python dev/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_$run.kb > $OUT/w1_warm_$run.txt 2>&1; echo "rc $?" >> $OUT/w1_warm_$run.txt
echo "== warm $run"; grep "^qwen-image: \|^rc" $OUT/w1_warm_$run.txt | cut -c1-250
timeout 280 python -m pytest tests/gpu -q --durations=5 -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests.txt
tail -12 $OUT/gpu_tests.txt
