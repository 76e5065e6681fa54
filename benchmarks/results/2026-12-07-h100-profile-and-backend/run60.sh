#!/bin/bash
# W1 FP8 cold and warm (module making profiled; the warm optimize profiled), the backend cold,
# then the whole GPU suite.
export PYTHONUNBUFFERED=1
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
git log -1 --format=%h > $OUT/code.txt 2>/dev/null; git status --short >> $OUT/code.txt 2>/dev/null
run=$1; rm -rf /tmp/r_$run.kb /tmp/tc_$run /tmp/rb_$run.kb /tmp/tcb_$run
TRITON_CACHE_DIR=/tmp/tc_$run timeout 100 python dev/madeprof.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_$run.kb > $OUT/w1_cold_$run.txt 2>&1; echo "rc $?" >> $OUT/w1_cold_$run.txt
grep "^qwen-image: \|^rc" $OUT/w1_cold_$run.txt | cut -c1-250
TRITON_CACHE_DIR=/tmp/tc_$run timeout 80 python dev/madeprof.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_$run.kb --profile 45 > $OUT/w1_warm_$run.txt 2>&1; echo "rc $?" >> $OUT/w1_warm_$run.txt
grep "^qwen-image: \|^rc" $OUT/w1_warm_$run.txt | cut -c1-250
if [ "$2" != "nobackend" ]; then
TRITON_CACHE_DIR=/tmp/tcb_$run timeout 170 python dev/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/rb_$run.kb --backend inductor > $OUT/w1_backend_$run.txt 2>&1; echo "rc $?" >> $OUT/w1_backend_$run.txt
grep "^qwen-image: \|^rc" $OUT/w1_backend_$run.txt | cut -c1-300
fi
timeout 40 python dev/host_thp.py > $OUT/host_thp.txt 2>&1; cat $OUT/host_thp.txt | grep -v Warn
timeout $3 python -m pytest tests/gpu -q -rf -n 5 -p no:cacheprovider > $OUT/gpu_tests_$run.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests_$run.txt
grep -v "^  \|Warn" $OUT/gpu_tests_$run.txt | tail -15 | cut -c1-300
