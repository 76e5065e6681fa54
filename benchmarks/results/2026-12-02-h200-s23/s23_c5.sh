source benchmarks/probes/s23_common.sh
date
timeout 290 python -m benchmarks.probes.interleaved --model qwen-image --fp8 --without merge_projections --without hoist --rounds 4 --steps 7 2>&1 | W | grep -v "^\s*$" | tail -20
date
