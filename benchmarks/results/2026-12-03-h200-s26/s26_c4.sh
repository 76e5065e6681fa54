source benchmarks/probes/s26_common.sh
date
timeout 230 python -m pytest -v -x tests/gpu/test_structural_gpu.py tests/gpu/test_foundation_gpu.py 2>&1 | grep -v "^DEBUG\|^\s*$" > $D/tests.txt
grep -E "PASSED|FAILED|ERROR|^E  |passed|failed" $D/tests.txt | cut -c1-200 | head -40
date
