source benchmarks/probes/s15_common.sh
set -x
export TRITON_CACHE_DIR=$D/tc
date
timeout 120 python benchmarks/probes/gemm_host_profile.py 2>&1 | W > $D/gemm_host.txt; tail -25 $D/gemm_host.txt
date
NCU_REPS=1 timeout 100 python -m benchmarks.probes.ncu_kernels > $D/compile.txt 2>&1
for f in $(find $D/tc -name "*.cubin"); do cuobjdump -sass $f > $f.sass 2>&1; done
ls $D/tc/*/ | head -50
date
for w in rowwise act; do
NCU_REPS=1 timeout 60 ncu --clock-control none -k regex:"rowwise_kernel|_act_quant_kernel" -c 1 \
  --metrics sass__inst_executed_per_opcode,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_fmaheavy.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed.sum \
  python -m benchmarks.probes.ncu_kernels $w > $D/ncu_op_$w.txt 2>&1
done
date
