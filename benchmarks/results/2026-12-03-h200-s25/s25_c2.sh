source benchmarks/probes/s25_common.sh
date
timeout 120 python -m benchmarks.probes.cupti_overhead 2>&1 | W | grep -v "^\s*$" | tail -20
date
timeout 420 python -m benchmarks.probes.replay_split --model qwen-image --fp8 --without merge_projections --rounds 3 --calibration 2>&1 | W | grep -v "^\s*$" | tail -50
date
