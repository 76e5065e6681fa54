source benchmarks/probes/s23_common.sh
date
timeout 100 python -m pytest -q -x tests/gpu/test_structural_gpu.py -k "cfg_pairs" -p no:logging 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E |Error|assert|passed|failed" | head -30
date
timeout 150 python -m benchmarks.probes.hoist_miss --model qwen-image --fp8 --steps 9 --phases-only 2>&1 | W | grep -v "^\s*$" | head -70
date
