source benchmarks/probes/s18_common.sh
set -x
date
mkdir -p /tmp/base && tar xf benchmarks/probes/s18_base.tar -C /tmp/base
REPO=$PWD
timeout 150 python -m pytest -q tests/gpu/test_codegen_gemm_gpu.py -k "split_k or cublas or direct or replays or matches_scaled_mm" -s 2>&1 | W > $D/tests_gemm.txt; grep -E "passed|failed|cuBLAS|template$|Error" $D/tests_gemm.txt | tail -12
timeout 100 python -m pytest -q tests/gpu/test_codegen_rowwise_gpu.py -k "nvfp4 or e2m1 or dispatch" 2>&1 | W > $D/tests_nvfp4.txt; tail -3 $D/tests_nvfp4.txt
date
for i in 1 2; do
  (cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 60 python -m benchmarks.probes.kernel_times --tag old --only rowwise --out $D/times.jsonl 2>&1 | W | grep -i nvfp4)
  timeout 60 python -m benchmarks.probes.kernel_times --tag new --only rowwise --out $D/times.jsonl 2>&1 | W | grep -i nvfp4
done
date
timeout 100 python -m benchmarks.probes.cat_tiles flat 2>&1 | W
date
timeout 150 python -m benchmarks.kernels_gemm --sweep --only W3 --out $D/sweep_w3.json 2>&1 | W > $D/sweep_w3.txt; tail -6 $D/sweep_w3.txt
date
