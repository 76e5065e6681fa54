source benchmarks/probes/s17_common.sh
set -x
date
mkdir -p /tmp/base && tar xf benchmarks/probes/s17_base.tar -C /tmp/base
REPO=$PWD
timeout 150 python -m pytest -q tests/gpu/test_cat_rows_gpu.py tests/gpu/test_act_quant_group_gpu.py 2>&1 | W > $D/tests.txt; tail -5 $D/tests.txt
(cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 60 python -m benchmarks.probes.kernel_times --tag old --only other --out $D/times.jsonl 2>&1 | W | grep -v QK)
timeout 150 python -m benchmarks.probes.kernel_times --tag new --only other --inductor --out $D/times.jsonl 2>&1 | W
(cd /tmp && PYTHONPATH=/tmp/base:/tmp/site:$REPO timeout 60 python -m benchmarks.probes.kernel_times --tag old --only other --out $D/times.jsonl 2>&1 | W | grep -v QK)
date
