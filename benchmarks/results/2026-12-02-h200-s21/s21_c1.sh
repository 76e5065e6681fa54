source benchmarks/probes/s21_common.sh
set -x
date
timeout 160 python -m benchmarks.probes.kernel_times --tag s21 --inductor --out $D/times.jsonl 2>&1 | W
date
timeout 360 python -m pytest -v tests/gpu/test_kernels_specialised_gpu.py tests/gpu/test_act_quant_group_gpu.py tests/gpu/test_codegen_rowwise_gpu.py tests/gpu/test_cat_rows_gpu.py tests/gpu/test_codegen_gemm_gpu.py tests/gpu/test_fp8_blockwise_gpu.py tests/gpu/test_rowwise_fusion_gpu.py tests/gpu/test_attention_fp8_gpu.py tests/gpu/test_profile_gpu.py --durations=15 2>&1 | W > $D/tests.txt
grep -E "passed|failed" $D/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $D/tests.txt | head -20; grep -E "replays .* s of the call" $D/tests.txt
date
