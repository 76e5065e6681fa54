source benchmarks/probes/s22_common.sh
set -x
date
timeout 560 python benchmarks/e2e.py --model flux2 --seeds 0 --iters 5 --variants kopt-fp8,naive-fp8-inductor,kopt-bf16,inductor-bf16,eager-bf16 --out-dir $D/w2 > $D/w2.txt 2>&1
grep -v -E "Warning|warn" $D/w2.txt | grep -E "ms/forward|floor|capture|Error|Traceback|summary" | cut -c1-300
cat $D/w2/e2e.md 2>/dev/null | head -40
date
