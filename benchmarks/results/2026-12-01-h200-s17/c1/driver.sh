source benchmarks/probes/s17_common.sh
set -x
date
mkdir -p /tmp/base && tar xf benchmarks/probes/s17_base.tar -C /tmp/base
REPO=$PWD
timeout 200 python -m pytest -q -x tests/gpu/test_kernels_specialised_gpu.py tests/gpu/test_act_quant_group_gpu.py tests/gpu/test_codegen_rowwise_gpu.py 2>&1 | W > $D/tests.txt; tail -8 $D/tests.txt
date
for i in 1 2; do
  (cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 60 python -m benchmarks.probes.kernel_times --tag old --only act --out $D/times.jsonl 2>&1 | W)
  timeout 60 python -m benchmarks.probes.kernel_times --tag new --only act --out $D/times.jsonl 2>&1 | W
  date
done
timeout 60 python -m benchmarks.probes.kernel_times --tag new --only rowwise --out $D/times.jsonl 2>&1 | W
timeout 90 python -m benchmarks.probes.act_onepass act 2>&1 | W
date
NCU_REPS=1 timeout 100 ncu --clock-control none -k regex:"_act_quant_kernel" \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section InstructionStats python -m benchmarks.probes.ncu_kernels act > $D/ncu.txt 2>&1
echo ncu rc=$?
grep -E "^  [_a-z]+kernel|Duration|DRAM Throughput|Issue Slots Busy|L2 Hit Rate|Registers Per|Achieved Occupancy|Executed Instructions  |No Eligible|Stall" $D/ncu.txt | head -60
date
