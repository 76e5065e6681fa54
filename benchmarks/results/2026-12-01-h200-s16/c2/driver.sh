source benchmarks/probes/s16_common.sh
set -x
date
NCU_REPS=1 timeout 120 ncu --clock-control none -k regex:"_act_quant_kernel|_quant_nvfp4_kernel" \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section InstructionStats python -m benchmarks.probes.ncu_kernels > $D/ncu.txt 2>&1
echo ncu rc=$?
grep -E "^  [_a-z]+kernel|Duration|DRAM Throughput|Issue Slots Busy|L2 Hit Rate|Registers Per|Achieved Occupancy|Executed Instructions  " $D/ncu.txt
date
timeout 200 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w1 2>&1 | W > $D/w1.txt; grep -A4 "ms/forward | ms/step" $D/w1.txt | tail -4; grep -A4 "by category" $D/w1.txt | tail -3
date
timeout 200 python benchmarks/e2e.py --model flux2 --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w2 2>&1 | W > $D/w2.txt; grep -A4 "ms/forward | ms/step" $D/w2.txt | tail -4; grep -A4 "by category" $D/w2.txt | tail -3
date
