source benchmarks/probes/s20_common.sh
set -x
date
timeout 90 python -m pytest -q tests/gpu/test_profile_gpu.py -s -x -k "clock_sampler or (replay and qwen)" 2>&1 | W | grep -E "passed|failed|Error|assert|MHz|replayed" | tail -12
timeout 470 python benchmarks/ablate.py --model flux2 --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --profile-rows 2 --pass fuse_qk_norm_rope --pass rowwise_fusion --pass fp8 --pass fuse_act_quant --out-dir $D/w2 2>&1 | W | while IFS= read -r l; do echo "$(date +%T) $l"; done > $D/w2.txt
grep -E "ablate |captured|built|calibration graph|Traceback|Error" $D/w2.txt
grep -A8 "Cost model vs" $D/w2.txt
date
