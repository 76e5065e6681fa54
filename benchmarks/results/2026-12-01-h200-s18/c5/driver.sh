source benchmarks/probes/s18_common.sh
set -x
date
timeout 150 python -m pytest -q tests/gpu/test_cat_rows_gpu.py tests/gpu/test_codegen_gemm_gpu.py -k "cat or cublas or split_k_replays" -s 2>&1 | W > $D/tests.txt; grep -E "passed|failed|cuBLAS|template;|Error" $D/tests.txt | tail -8
date
timeout 100 python -m benchmarks.probes.kernel_times --tag new --only other --inductor --out $D/times.jsonl 2>&1 | W | grep -E "cat_rows|kopt from"
date
timeout 100 python -m benchmarks.kernels_gemm --only W1 --case "img QKV" --case txt --no-epilogues --out $D/gemm_w1.json 2>&1 | W | tail -6
date
