#!/bin/bash
# call 2: streams GPU tests, W1 e2e with and without the side stream, stream probe
source setup.sh  # the 9 lines each call ran here
timeout 100 python -m pytest tests/gpu/test_streams_gpu.py tests/gpu/test_runtime_gpu.py -q -rf -x -n 4 -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests.txt
grep -v "^  \|Warn" $OUT/gpu_tests.txt | tail -25 | cut -c1-300
L=$(( $(left) - 60 )); echo "e2e gets $L s"
timeout $L python -m benchmarks.e2e --model qwen-image --variants naive-fp8-inductor,kopt-fp8 --one-stream-row --seeds 1 --out-dir $OUT/e2e_w1 > $OUT/e2e_w1.txt 2>&1; echo "rc $?" >> $OUT/e2e_w1.txt
grep -v "Warn\|^  return\|^  \"\"\"" $OUT/e2e_w1.txt | grep -i "ms\|stream\|rc \|error\|Trace\|plan" | tail -30 | cut -c1-250
sed -n 1,12p $OUT/e2e_w1/e2e.md 2>/dev/null | cut -c1-250
L=$(( $(left) - 5 )); echo "left $L s"
[ $L -gt 30 ] && (timeout $(( L / 2 )) python -m benchmarks.probes.stream_overlap --layers 20 --copies --rounds 3; timeout $(( L / 2 - 5 )) python -m benchmarks.probes.stream_overlap --layers 20 --copies --rounds 3 --eager) 2>&1 | grep -v Warn | tail -16 | cut -c1-200
