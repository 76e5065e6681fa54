source benchmarks/probes/s15_common.sh
set -x
date
which ncu; ncu --version | tail -1
NCU_REPS=1 timeout 150 ncu --clock-control none -k regex:"rowwise_kernel|_act_quant_kernel|_quant_nvfp4_kernel" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section InstructionStats python -m benchmarks.probes.ncu_kernels > $D/ncu.txt 2>&1
echo ncu rc=$?
date
timeout 150 python -m pytest -q -x tests/gpu/test_codegen_gemm_gpu.py "tests/gpu/test_structural_gpu.py" -k "gemm" 2>&1 | W | tail -15
date
timeout 60 python -m benchmarks.gemm_launch_cost 2>&1 | W > $D/launch_cost.txt; tail -20 $D/launch_cost.txt
date
timeout 230 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --enable triton_gemm --enable gemm_epilogue --out-dir $D/w1_tg 2>&1 | W > $D/w1_tg.txt; tail -12 $D/w1_tg.txt
date
timeout 100 python -m pytest -q tests/gpu/test_codegen_rowwise_gpu.py tests/gpu/test_act_quant_group_gpu.py 2>&1 | W | tail -8
date
