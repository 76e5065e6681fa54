source benchmarks/probes/s18_common.sh
set -x
date
timeout 200 python -m benchmarks.probes.cat_tiles 2>&1 | W
date
timeout 250 python -m benchmarks.kernels_gemm --sweep --case txt --out $D/sweep_txt.json 2>&1 | W > $D/sweep_txt.txt; tail -40 $D/sweep_txt.txt
date
