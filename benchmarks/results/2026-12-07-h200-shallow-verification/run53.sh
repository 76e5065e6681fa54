#!/bin/bash
# W1 FP8 cold at the default (checked on 2 blocks); the GPU tests that failed or are new.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
run=new_d; rm -rf /tmp/r_$run.kb /tmp/tc_$run
TRITON_CACHE_DIR=/tmp/tc_$run timeout 95 python dev/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_$run.kb > $OUT/w1_cold_$run.txt 2>&1; echo "rc $?" >> $OUT/w1_cold_$run.txt
grep "^qwen-image: \|^rc\|verif\|FAIL\|Error" $OUT/w1_cold_$run.txt | cut -c1-300
timeout 100 python -m pytest tests/gpu/test_foundation_gpu.py tests/gpu/test_shallow_gpu.py -q -rf -n 5 -p no:cacheprovider > $OUT/gpu_tests_subset.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests_subset.txt
grep -v "^  \|Warn" $OUT/gpu_tests_subset.txt | tail -25 | cut -c1-300
