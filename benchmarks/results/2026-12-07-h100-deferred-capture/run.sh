#!/bin/bash
# W1 FP8 kopt.optimize cold (kopt's log timestamped) then warm, at this tree; then the GPU tests.
cd "$(git rev-parse --show-toplevel)"  # on the device machine
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
cat $OUT/gpu.txt
rm -f /tmp/new.kb
for run in cold warm; do
  timeout 110 python benchmarks/results/2026-12-06-h100-pass-memo/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/new.kb > $OUT/w1_$run.txt 2>&1
  echo "rc $?" >> $OUT/w1_$run.txt
  echo "== $run"; grep -v "Warn\|torchao\|FQNs\|return cls\|^  " $OUT/w1_$run.txt | tail -6
done
[ -n "$NOTESTS" ] && exit 0
N="-n ${W:-5}"; python -c "import xdist" 2>/dev/null || N=""
timeout ${GPU_T:-300} python -m pytest -q $N -p no:cacheprovider -rfE --durations=12 ${TESTS:-tests/gpu} > $OUT/gpu_tests.txt 2>&1
echo "rc $?" >> $OUT/gpu_tests.txt
tail -30 $OUT/gpu_tests.txt
