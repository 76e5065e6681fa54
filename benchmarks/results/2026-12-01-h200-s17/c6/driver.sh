source benchmarks/probes/s17_common.sh
set -x
date
timeout 200 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w1 2>&1 | W > $D/w1.txt; grep -A4 "ms/forward | ms/step" $D/w1.txt | tail -4; grep -A4 "by category" $D/w1.txt | tail -3; grep "_act_quant_kernel\|_cat_rows_kernel" $D/w1.txt | head -2
date
