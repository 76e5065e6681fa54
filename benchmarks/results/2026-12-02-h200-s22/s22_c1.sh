source benchmarks/probes/s22_common.sh
set -x
date
timeout 90 python -m pytest -q tests/gpu/test_floor_gpu.py -s -x 2>&1 | W | tail -8
date
timeout 470 python benchmarks/e2e.py --model qwen-image --seeds 0 --iters 5 --variants kopt-fp8,naive-fp8-inductor,kopt-bf16,inductor-bf16,eager-bf16 --out-dir $D/w1 > $D/w1.txt 2>&1
grep -v -E "Warning|warn" $D/w1.txt | grep -E "ms/forward|floor|capture|Error|Traceback|passes|verif" | cut -c1-300
cat $D/w1/e2e.md 2>/dev/null | head -60
date
