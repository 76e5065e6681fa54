source benchmarks/probes/s15_common.sh
set -x
date
timeout 60 python benchmarks/probes/gemm_direct_debug.py 2>&1 | W | tail -30
date
timeout 60 python benchmarks/kernels_specialised.py --only act --cases fast --out $D/act.json 2>&1 | W > $D/act.txt; cat $D/act.txt
date
timeout 280 python benchmarks/e2e.py --model flux2 --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w2 2>&1 | W > $D/w2.txt; grep -A4 "ms/forward | ms/step" $D/w2.txt | tail -4; grep -A4 "by category" $D/w2.txt | tail -3
date
