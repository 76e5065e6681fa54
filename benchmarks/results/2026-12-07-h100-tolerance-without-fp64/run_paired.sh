#!/bin/bash
# W1 FP8 cold at the previous commit (dev/old4) and at this tree, on one host; warm twice at
# this tree; then every GPU test.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
git rev-parse HEAD > $OUT/commit.txt 2>/dev/null
rm -f /tmp/new.kb /tmp/old.kb
(cd dev/old4 && TRITON_CACHE_DIR=/tmp/tc_old PYTHONPATH=/tmp/site:$PWD timeout 110 python ../logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/old.kb > $OUT/w1_cold_before.txt 2>&1; echo "rc $?" >> $OUT/w1_cold_before.txt)
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc_new
timeout 110 python logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/new.kb > $OUT/w1_cold.txt 2>&1
echo "rc $?" >> $OUT/w1_cold.txt
for i in 1 2; do
  timeout 80 python logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/new.kb > $OUT/w1_warm_$i.txt 2>&1
  echo "rc $?" >> $OUT/w1_warm_$i.txt
done
for f in w1_cold_before w1_cold w1_warm_1 w1_warm_2; do echo "== $f"; grep "^qwen-image: capture\|warm start\|made in\|peak\|^rc" $OUT/$f.txt | cut -c1-240; done
[ -n "$NOTESTS" ] && exit 0
N="-n ${W:-5}"; python -c "import xdist" 2>/dev/null || N=""
timeout ${GPU_T:-300} python -m pytest -q $N -p no:cacheprovider -rfE --durations=12 ${TESTS:-tests/gpu} > $OUT/gpu_tests.txt 2>&1
echo "rc $?" >> $OUT/gpu_tests.txt
tail -4 $OUT/gpu_tests.txt
