python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cp dev/head.txt $OUT/commit.txt; nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
rm -f /tmp/w1kb.sqlite*
for run in cold warm; do
  timeout 100 python3 -m benchmarks.probes.optimize_time --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/w1kb.sqlite 2>&1 | grep -v "Warn\|cls.__new\|torchao\|Configuration class" | tee $OUT/w1_$run.txt
done
timeout 80 python3 -m benchmarks.probes.optimize_time --model qwen-image --device cuda --fp8 2>&1 | grep -v "Warn\|cls.__new\|torchao\|Configuration class" | tee $OUT/w1_noverify.txt
timeout 330 python3 -m pytest -q -n 3 -p no:cacheprovider -rfE tests/gpu --junitxml=$OUT/gpu.xml > $OUT/gpu_tests.txt 2>&1
tail -30 $OUT/gpu_tests.txt
