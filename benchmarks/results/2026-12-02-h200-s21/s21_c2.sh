source benchmarks/probes/s21_common.sh
set -x
date
timeout 70 python -m pytest -q tests/gpu/test_profile_gpu.py -s -x -k "replay and qwen" 2>&1 | W | grep -E "passed|failed|Error|assert|replays" | tail -6
date
timeout 480 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --profile-rows 2 --pass rowwise_fusion --pass fuse_act_quant --pass hoist --pass remove_noops --out-dir $D/w1 > $D/w1.txt 2>&1
grep -E "^ablate |captured|built|calibration graph|Traceback|Error" $D/w1.txt | cut -c1-400
grep -A8 "Cost model vs" $D/w1.txt
date
