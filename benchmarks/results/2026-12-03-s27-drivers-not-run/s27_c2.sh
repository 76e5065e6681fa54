source benchmarks/probes/s27_common.sh
# every GPU test file but the two run in session 26 and the two-GPU one; a file whose log
# (in any earlier call's folder) has its summary is not run again
for f in tests/gpu/test_*_gpu.py; do
  n=$(basename $f .py)
  case $n in test_tp_gpu|test_structural_gpu|test_foundation_gpu) continue;; esac
  cat /tmp/c*/t_$n.txt 2>/dev/null | grep -qE "[0-9]+ (passed|failed)" && continue
  echo "$(date +%T) $n"
  python -m pytest -q -p no:cacheprovider $f 2>&1 | grep -v "^DEBUG\|^\s*$" | W > $D/t_$n.txt
  grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" $D/t_$n.txt | cut -c1-200 | tail -8
done
date
