source benchmarks/probes/s25_common.sh
date
timeout 150 python -m benchmarks.probes.miss_in_step --model qwen-image --fp8 --without merge_projections --rounds 3 2>&1 | W | grep -v "^\s*$" | tail -30
date
