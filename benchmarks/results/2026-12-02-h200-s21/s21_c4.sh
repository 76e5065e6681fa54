source benchmarks/probes/s21_common.sh
set -x
date
timeout 200 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --profile-iters 3 --pass rowwise_fusion --pass fuse_act_quant --pass hoist --pass remove_noops --calibrate-only --out-dir $D/w1 > $D/w1.txt 2>&1
grep -E "captured|calibration graph|Traceback|Error" $D/w1.txt | cut -c1-400
date
