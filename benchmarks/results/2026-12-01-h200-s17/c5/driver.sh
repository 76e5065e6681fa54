source benchmarks/probes/s17_common.sh
set -x
date
timeout 230 python -m pytest -q tests/gpu/test_kernels_specialised_gpu.py tests/gpu/test_act_quant_group_gpu.py tests/gpu/test_codegen_rowwise_gpu.py tests/gpu/test_cat_rows_gpu.py 2>&1 | W > $D/tests.txt; tail -5 $D/tests.txt
date
timeout 150 python -m benchmarks.probes.kernel_times --tag new --out $D/times.jsonl 2>&1 | W
date
