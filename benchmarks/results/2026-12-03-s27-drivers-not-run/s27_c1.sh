source benchmarks/probes/s27_common.sh
date
python -m benchmarks.probes.build_alone --model qwen-image --fp8 --without merge_projections --rounds 3 2>&1 | W | stamp
date
