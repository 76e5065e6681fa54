source benchmarks/probes/s24_common.sh
date
timeout 130 python -m pytest -q tests/gpu/test_gemm_blockwise_gpu.py -p no:logging -s 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E  .*(Error|assert)|passed|failed|FAILED|kopt .*cuBLAS" | head -30
date
timeout 250 python -m pytest -q tests/gpu/test_codegen_gemm_gpu.py -p no:logging 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E  .*(Error|assert)|passed|failed|FAILED" | head -20
date
