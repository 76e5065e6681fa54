source benchmarks/probes/s20_common.sh
set -x
date
timeout 420 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --device-model benchmarks/results/2026-12-02-h200-s20/c2-w1-device_model.json --pass fuse_qk_norm_rope --pass rowwise_fusion --pass hoist --pass fuse_act_quant --out-dir $D/w1 > $D/w1.txt 2>&1
grep -E "^ablate |captured|built|Traceback|Error" $D/w1.txt | cut -c1-300
date
