source benchmarks/probes/s15_common.sh
set -x
timeout 100 python -m benchmarks.probes.act_stream 2>&1 | W | tail -5
timeout 60 python -m pytest -q tests/gpu/test_kernels_specialised_gpu.py -k "act" 2>&1 | W | tail -3
