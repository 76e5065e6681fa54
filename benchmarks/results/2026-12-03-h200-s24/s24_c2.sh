source benchmarks/probes/s24_common.sh
date
timeout 150 python -m pytest -q tests/gpu/test_gemm_blockwise_gpu.py -p no:logging -s 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E |Error|assert|passed|failed|kopt .*cuBLAS" | head -40
date
timeout 260 python -m benchmarks.kernels_gemm --blockwise --only W1 --case img --case txt --out $D/bw_w1.json 2>&1 | W | grep -v "^\s*$" | tail -30
date
timeout 120 python -m pytest -q tests/gpu/test_codegen_gemm_gpu.py -p no:logging 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E |Error|passed|failed" | head -20
date
