#!/bin/bash
# call 3: streams GPU tests; if they pass, W1 e2e with and without the side stream, else the suite
source setup.sh  # the 9 lines each call ran here
timeout 90 python -m pytest tests/gpu/test_streams_gpu.py tests/gpu/test_runtime_gpu.py -q -rf -n 6 -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; RC=$?; echo "rc $RC" >> $OUT/gpu_tests.txt
grep -v "^  \|Warn\|DEBUG" $OUT/gpu_tests.txt | tail -12 | cut -c1-300
if [ $RC = 0 ]; then
  L=$(( $(left) - 10 )); echo "e2e gets $L s"
  timeout $L python -m benchmarks.e2e --model qwen-image --variants naive-fp8-inductor,kopt-fp8 --one-stream-row --seeds 0 --iters 5 --error-inputs 1 --out-dir $OUT/e2e_w1 > $OUT/e2e_w1.txt 2>&1; echo "rc $?" >> $OUT/e2e_w1.txt
  grep -v "Warn\|^  return\|^  \"\"\"" $OUT/e2e_w1.txt | grep -i "ms/forward\|stream\|rc \|error\|Trace" | tail -20 | cut -c1-250
  sed -n 5,12p $OUT/e2e_w1/e2e.md 2>/dev/null | cut -c1-250
  L=$(( $(left) - 8 )); echo "suite gets $L s"
  timeout $L python -m pytest tests/gpu -q -rf -n 8 -p no:cacheprovider --ignore=tests/gpu/test_streams_gpu.py --ignore=tests/gpu/test_runtime_gpu.py --ignore=tests/gpu/test_regional_gpu.py > $OUT/gpu_suite.txt 2>&1; echo "rc $?" >> $OUT/gpu_suite.txt
  grep -v "^  \|Warn\|DEBUG" $OUT/gpu_suite.txt | tail -15 | cut -c1-300
else
  L=$(( $(left) - 10 )); echo "suite gets $L s"
  timeout $L python -m pytest tests/gpu -q -rf -n 8 -p no:cacheprovider > $OUT/gpu_suite.txt 2>&1; echo "rc $?" >> $OUT/gpu_suite.txt
  grep -v "^  \|Warn\|DEBUG" $OUT/gpu_suite.txt | tail -15 | cut -c1-300
fi
