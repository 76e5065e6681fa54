#!/bin/bash
# W1 FP8 kopt.optimize cold with kopt's log timestamped, then warm under cProfile; then the backend cold+warm.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
rm -f /tmp/w1.kb
timeout 110 python dev/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/w1.kb > $OUT/w1_cold_log.txt 2>&1
echo "rc $?" >> $OUT/w1_cold_log.txt
grep -v "Warn\|torchao\|FQNs\|return cls\|^  " $OUT/w1_cold_log.txt | tail -40
timeout 80 python dev/prof.py $OUT/w1_warm_prof.txt 70 -- --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/w1.kb > $OUT/w1_warm.txt 2>&1
echo "rc $?" >> $OUT/w1_warm.txt
grep -v "Warn\|torchao\|FQNs\|return cls\|^  " $OUT/w1_warm.txt | tail -5
rm -f /tmp/w1b.kb
for run in ${BACKEND_RUNS:-}; do
  timeout ${BT:-150} python -m benchmarks.probes.optimize_time --model qwen-image --device cuda --fp8 --verify 1 --backend inductor --kb /tmp/w1b.kb 2>&1 | grep -v "Warn\|torchao\|FQNs\|return cls" > $OUT/w1_backend_$run.txt
  echo "rc ${PIPESTATUS[0]}" >> $OUT/w1_backend_$run.txt
  grep -v "^  " $OUT/w1_backend_$run.txt | tail -5
done
