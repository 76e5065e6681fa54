source benchmarks/probes/s16_common.sh
set -x
date
mkdir -p /tmp/base && tar xf benchmarks/probes/s16_base.tar -C /tmp/base
REPO=$PWD
timeout 230 python -m pytest -q tests/gpu/test_codegen_rowwise_gpu.py tests/gpu/test_kernels_specialised_gpu.py tests/gpu/test_act_quant_group_gpu.py tests/gpu/test_fp8_blockwise_gpu.py 2>&1 | W > $D/tests.txt; tail -15 $D/tests.txt
date
for i in 1 2; do
  (cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 90 python -m benchmarks.probes.kernel_times --tag old --out $D/times.jsonl 2>&1 | W)
  timeout 90 python -m benchmarks.probes.kernel_times --tag new --out $D/times.jsonl 2>&1 | W
  date
done
