source benchmarks/probes/s15_common.sh
set -x
date
timeout 90 python -m pytest -q "tests/gpu/test_codegen_gemm_gpu.py::test_direct_launch_equals_the_autotuned_launch" "tests/gpu/test_codegen_gemm_gpu.py::test_fp8_gemm_replays_in_a_cuda_graph_and_compiles" 2>&1 | W | tail -3
timeout 60 python benchmarks/probes/gemm_direct_debug.py 2>&1 | W | grep -v names | tail -12
timeout 60 python -m benchmarks.gemm_launch_cost 2>&1 | W > $D/launch_cost.txt; cat $D/launch_cost.txt
date
timeout 200 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8 --seeds 0 --iters 5 --enable triton_gemm --out-dir $D/w1_tg 2>&1 | W > $D/w1_tg.txt; grep -A3 "ms/forward | ms/step" $D/w1_tg.txt | tail -2; grep -A4 "by category" $D/w1_tg.txt | tail -1
date
