source benchmarks/probes/s21_common.sh
set -x
date
timeout 70 python -m pytest -q tests/gpu/test_profile_gpu.py -s -x -k "replay" 2>&1 | W | grep -E "passed|failed|Error|assert|replays" | tail -8
date
timeout 400 python benchmarks/ablate.py --model flux2 --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --profile-rows 2 --pass fuse_qk_norm_rope --pass rowwise_fusion --pass fp8 --pass fuse_act_quant --out-dir $D/w2 > $D/w2.txt 2>&1
grep -E "^ablate |captured|built|calibration graph|power|Traceback|Error" $D/w2.txt | cut -c1-400
grep -A8 "Cost model vs" $D/w2.txt
date
