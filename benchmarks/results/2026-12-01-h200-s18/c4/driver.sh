source benchmarks/probes/s18_common.sh
set -x
date
mkdir -p /tmp/base && tar xf benchmarks/probes/s18_base.tar -C /tmp/base
REPO=$PWD
timeout 120 python -m pytest -q tests/gpu/test_cat_rows_gpu.py tests/gpu/test_codegen_gemm_gpu.py -k "cat or cublas or split_k" -s 2>&1 | W > $D/tests.txt; grep -E "passed|failed|cuBLAS|template$|Error" $D/tests.txt | tail -8
date
timeout 150 python -m benchmarks.kernels_gemm --only W3 --no-epilogues --out $D/gemm_w3.json 2>&1 | W | tail -6
timeout 100 python -m benchmarks.kernels_gemm --only W1 --case txt --no-epilogues --out $D/gemm_w1txt.json 2>&1 | W | tail -5
date
(cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 60 python -m benchmarks.probes.kernel_times --tag old --only other --out $D/times.jsonl 2>&1 | W | grep cat_rows)
timeout 200 python -m benchmarks.probes.kernel_times --tag new --only other --inductor --out $D/times.jsonl 2>&1 | W
date
