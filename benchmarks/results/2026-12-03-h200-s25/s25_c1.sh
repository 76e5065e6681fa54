source benchmarks/probes/s25_common.sh
date
nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE | grep -v "^\s*$" | head -60
timeout 130 python -m pytest -q tests/gpu/test_gemm_blockwise_gpu.py -p no:logging 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E  .*(Error|assert)|passed|failed|FAILED" | head -30
date
timeout 390 python -m benchmarks.probes.replay_split --model qwen-image --fp8 --without merge_projections --rounds 4 2>&1 | W | grep -v "^\s*$" | tail -60
date
nvidia-smi -q -d PERFORMANCE | grep -v "^\s*$" | head -30
