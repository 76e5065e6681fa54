source benchmarks/probes/s23_common.sh
date
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
timeout 400 python -m benchmarks.probes.hoist_miss --model qwen-image --fp8 --steps 9 2>&1 | W
date
