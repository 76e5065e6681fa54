#!/bin/bash
# W1 FP8 cold at this code, then warm starts alternated with the host moves of the code before
# (KOPT_AB=old), then the whole GPU suite.
export PYTHONUNBUFFERED=1
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
git log -1 --format=%h > $OUT/code.txt 2>/dev/null; git status --short >> $OUT/code.txt 2>/dev/null
rm -rf /tmp/r_b.kb /tmp/tc_b
TRITON_CACHE_DIR=/tmp/tc_b timeout 100 python dev/abrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_b.kb > $OUT/w1_cold.txt 2>&1; echo "rc $?" >> $OUT/w1_cold.txt
grep "^qwen-image: \|^rc" $OUT/w1_cold.txt | cut -c1-250
for i in 1; do for v in new old; do
KOPT_AB=$v TRITON_CACHE_DIR=/tmp/tc_b timeout 60 python dev/abrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_b.kb > $OUT/w1_warm_${v}_$i.txt 2>&1; echo "rc $?" >> $OUT/w1_warm_${v}_$i.txt
grep "^qwen-image: capture\|made in\|^rc\|peak" $OUT/w1_warm_${v}_$i.txt | cut -c1-200
done; done
timeout $1 python -m pytest tests/gpu -q -rf -n 5 -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests.txt
grep -v "^  \|Warn" $OUT/gpu_tests.txt | tail -15 | cut -c1-300
