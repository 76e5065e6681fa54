source benchmarks/probes/s16_common.sh
set -x
date
timeout 150 python -m pytest -q tests/gpu/test_kernels_specialised_gpu.py tests/gpu/test_act_quant_group_gpu.py "tests/gpu/test_codegen_rowwise_gpu.py::test_nvfp4_producer_bitwise_on_cuda" 2>&1 | W > $D/tests.txt; tail -5 $D/tests.txt
date
timeout 60 python -m benchmarks.probes.kernel_times --tag new --only act --out $D/times.jsonl 2>&1 | W
date
timeout 170 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w1 2>&1 | W > $D/w1.txt; grep -A4 "ms/forward | ms/step" $D/w1.txt | tail -4; grep -A4 "by category" $D/w1.txt | tail -3
date
timeout 150 python benchmarks/e2e.py --model flux2 --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w2 2>&1 | W > $D/w2.txt; grep -A4 "ms/forward | ms/step" $D/w2.txt | tail -4; grep -A4 "by category" $D/w2.txt | tail -3
date
