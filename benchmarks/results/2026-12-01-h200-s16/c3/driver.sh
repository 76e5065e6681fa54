source benchmarks/probes/s16_common.sh
set -x
date
timeout 300 python -m benchmarks.probes.act_onepass 2>&1 | W
date
