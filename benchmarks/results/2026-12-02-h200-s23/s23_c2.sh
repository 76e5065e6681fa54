source benchmarks/probes/s23_common.sh
date
timeout 120 python -m pytest -q tests/gpu/test_structural_gpu.py -k "cuda_graph" 2>&1 | tail -5
date
timeout 200 python -m benchmarks.probes.hoist_miss --model qwen-image --fp8 --steps 9 2>&1 | W | grep -v "^\s*$" | head -24
date
timeout 260 python benchmarks/e2e.py --model qwen-image --seeds 0 --iters 5 --variants kopt-fp8,naive-fp8-inductor --out-dir $D/e2e > $D/e2e.txt 2>&1
tail -30 $D/e2e.txt | W
date
