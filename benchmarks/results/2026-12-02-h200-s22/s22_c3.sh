source benchmarks/probes/s22_common.sh
set -x
date
timeout 560 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --profile-rows 2 --pass hoist --pass cse --pass fp8 --pass fuse_qk_norm_rope --out-dir $D/w1 > $D/w1.txt 2>&1
grep -E "^ablate |captured|built|calibration graph|miss|Traceback|Error" $D/w1.txt | cut -c1-400
grep -A10 "Cost model vs" $D/w1.txt
date
