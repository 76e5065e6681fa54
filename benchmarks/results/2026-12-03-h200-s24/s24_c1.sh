source benchmarks/probes/s24_common.sh
date
timeout 100 python -m pytest -q -x tests/gpu/test_structural_gpu.py -k "cfg_pairs" -p no:logging 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E |Error|assert|passed|failed" | head -30
date
timeout 330 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --profile-rows 2 --pass merge_projections --out-dir $D/w1 > $D/w1.txt 2>&1
grep -E "^ablate |calibration graph|miss|Traceback|Error" $D/w1.txt | cut -c1-300
grep -B2 -A8 "leave-one-out, replayed" $D/w1.txt
date
timeout 240 python -m benchmarks.probes.interleaved --model qwen-image --fp8 --without merge_projections --hits --rounds 4 --steps 6 2>&1 | W | grep -v "^\s*$" | tail -20
date
