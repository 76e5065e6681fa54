source benchmarks/probes/s17_common.sh
set -x
date
mkdir -p /tmp/base && tar xf benchmarks/probes/s17_base.tar -C /tmp/base
REPO=$PWD
timeout 60 python -m pytest -q tests/gpu/test_cat_rows_gpu.py 2>&1 | W | tail -3
(cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 60 python -m benchmarks.probes.kernel_times --tag old --only other --out $D/times.jsonl 2>&1 | W | grep -v QK)
timeout 150 python -m benchmarks.probes.kernel_times --tag new --only other --inductor --out $D/times.jsonl 2>&1 | W
date
timeout 170 python benchmarks/e2e.py --model qwen-image --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w1 2>&1 | W > $D/w1.txt; grep -A4 "ms/forward | ms/step" $D/w1.txt | tail -4; grep -A4 "by category" $D/w1.txt | tail -3
date
timeout 150 python benchmarks/e2e.py --model flux2 --variants kopt-fp8,naive-fp8-inductor --seeds 0 --iters 5 --out-dir $D/w2 2>&1 | W > $D/w2.txt; grep -A4 "ms/forward | ms/step" $D/w2.txt | tail -4; grep -A4 "by category" $D/w2.txt | tail -3
date
