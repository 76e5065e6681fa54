#!/bin/bash
# call 1: stream overlap probe, text GEMM sweep, GPU suite, regional speed
source setup.sh  # the 9 lines each call ran here
timeout 60 python -m benchmarks.probes.stream_overlap --layers 20 > $OUT/probes.txt 2>&1; echo "rc $?" >> $OUT/probes.txt
timeout 60 python -m benchmarks.probes.stream_overlap --layers 20 --copies >> $OUT/probes.txt 2>&1; echo "rc $?" >> $OUT/probes.txt
cat $OUT/probes.txt | grep -v Warn | cut -c1-200
timeout 150 python -m benchmarks.kernels_gemm --sweep --only W1 --case txt --out $OUT/sweep_txt.json > $OUT/sweep.txt 2>&1; echo "rc $?" >> $OUT/sweep.txt
tail -40 $OUT/sweep.txt | cut -c1-200
L=$(( $(left) - 130 )); [ $L -gt 220 ] && L=220; echo "suite gets $L s"
timeout $L python -m pytest tests/gpu -q -rf -n 8 -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests.txt
grep -v "^  \|Warn" $OUT/gpu_tests.txt | tail -12 | cut -c1-300
L=$(( $(left) - 10 )); echo "left $L s"
[ $L -gt 60 ] && timeout $L python -m benchmarks.probes.regional_speed --model qwen-image --blocks 12 --fp8 --device cuda > $OUT/regional_speed.txt 2>&1; echo "rc $?" >> $OUT/regional_speed.txt
tail -25 $OUT/regional_speed.txt | cut -c1-250
