source benchmarks/probes/s15_common.sh
set -x
date
timeout 200 python -m pytest -q tests/gpu/test_codegen_rowwise_gpu.py tests/gpu/test_act_quant_group_gpu.py tests/gpu/test_kernels_specialised_gpu.py tests/gpu/test_fp8_blockwise_gpu.py "tests/gpu/test_codegen_gemm_gpu.py::test_direct_launch_equals_the_autotuned_launch" "tests/gpu/test_codegen_gemm_gpu.py::test_fp8_gemm_replays_in_a_cuda_graph_and_compiles" "tests/gpu/test_codegen_gemm_gpu.py::test_fp8_tma_and_pointer_paths_agree" 2>&1 | W > $D/tests.txt; tail -15 $D/tests.txt
date
timeout 60 python -m benchmarks.gemm_launch_cost 2>&1 | W > $D/launch_cost.txt; cat $D/launch_cost.txt
date
timeout 100 python benchmarks/kernels_rowwise.py --workloads W1,W2 --cases fp8 --no-inductor --out $D/rowwise.json 2>&1 | W > $D/rowwise.txt; cat $D/rowwise.txt
date
timeout 60 python benchmarks/kernels_specialised.py --only act --cases fast --out $D/act.json 2>&1 | W > $D/act.txt; cat $D/act.txt
date
timeout 200 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w1 2>&1 | W > $D/w1.txt; grep -A4 "ms/forward | ms/step" $D/w1.txt | tail -4; grep -A4 "by category" $D/w1.txt | tail -3
date
