#!/bin/bash
# on the same machine right after run53.sh: the warm start, then the backend tests with kopt's
# entry point visible (kopt is on PYTHONPATH, not installed: a dist-info names the backend)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
TRITON_CACHE_DIR=/tmp/tc_new_d timeout 75 python dev/logrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_new_d.kb > $OUT/w1_warm_new_d.txt 2>&1; echo "rc $?" >> $OUT/w1_warm_new_d.txt
timeout 90 python -m pytest tests/gpu/test_foundation_gpu.py -q -rf -n 4 -p no:cacheprovider -k backend > $OUT/gpu_tests_backend.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests_backend.txt
