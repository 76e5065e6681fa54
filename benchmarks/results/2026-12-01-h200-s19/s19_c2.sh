source benchmarks/probes/s19_common.sh
set -x
date
timeout 60 python -m benchmarks.probes.replay_trace > $D/replay_trace.txt 2>&1
head -c 6000 $D/replay_trace.txt
timeout 470 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --paired --pass cse --pass fuse_qk_norm_rope --pass fp8 --pass rowwise_fusion --pass absorb_bias --pass merge_projections --pass remove_noops --pass fuse_act_quant --pass cat_rows --pass hoist --out-dir $D/w1 2>&1 | W > $D/w1.txt
grep -E "ablate |captured|built|calibration graph" $D/w1.txt
date
