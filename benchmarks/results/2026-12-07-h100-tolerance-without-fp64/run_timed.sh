#!/bin/bash
# W1 FP8 cold with per-pass check timers, then warm under cProfile, at this tree.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
rm -f /tmp/new.kb
timeout 150 python checkprof.py $OUT/checkprof.txt -- --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/new.kb > $OUT/w1_cold.txt 2>&1
echo "rc $?" >> $OUT/w1_cold.txt
grep "verdict\|\[" $OUT/w1_cold.txt | cut -c1-200
grep -v "Warn\|torchao\|FQNs\|return cls\|^  " $OUT/w1_cold.txt | tail -5
grep ALL $OUT/checkprof.txt
timeout 100 python logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/new.kb > $OUT/w1_warm.txt 2>&1
echo "rc $?" >> $OUT/w1_warm.txt
grep -v "Warn\|torchao\|FQNs\|return cls\|^  " $OUT/w1_warm.txt | tail -6
timeout 150 python prof.py $OUT/w1_warm_profile.txt 90 -- --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/new.kb > $OUT/w1_warm_profiled.txt 2>&1
echo "rc $?" >> $OUT/w1_warm_profiled.txt
tail -3 $OUT/w1_warm_profiled.txt
