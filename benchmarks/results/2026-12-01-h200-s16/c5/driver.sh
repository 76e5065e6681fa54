source benchmarks/probes/s16_common.sh
set -x
date
mkdir -p /tmp/base && tar xf benchmarks/probes/s16_base.tar -C /tmp/base
REPO=$PWD
timeout 120 python -m pytest -q tests/gpu/test_kernels_specialised_gpu.py tests/gpu/test_act_quant_group_gpu.py 2>&1 | W > $D/tests.txt; tail -5 $D/tests.txt
date
(cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 50 python -m benchmarks.probes.kernel_times --tag old --only act --out $D/times.jsonl 2>&1 | W)
timeout 50 python -m benchmarks.probes.kernel_times --tag new --only act --out $D/times.jsonl 2>&1 | W
date
timeout 160 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w1 2>&1 | W > $D/w1.txt; grep -A4 "ms/forward | ms/step" $D/w1.txt | tail -4; grep -A4 "by category" $D/w1.txt | tail -3; grep _act_quant_kernel $D/w1.txt | head -1
date
timeout 130 python benchmarks/e2e.py --model flux2 --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w2 2>&1 | W > $D/w2.txt; grep -A4 "ms/forward | ms/step" $D/w2.txt | tail -4; grep _act_quant_kernel $D/w2.txt | head -1
date
