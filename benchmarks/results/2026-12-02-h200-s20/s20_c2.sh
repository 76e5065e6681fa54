source benchmarks/probes/s20_common.sh
set -x
date
timeout 30 python -c "from kopt.power import read_power_limit; print('power limit, copy W, max MHz:', read_power_limit('cuda'))"
timeout 500 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --pass cse --pass fuse_qk_norm_rope --pass fp8 --pass rowwise_fusion --pass absorb_bias --pass merge_projections --pass remove_noops --pass fuse_act_quant --pass cat_rows --pass hoist --out-dir $D/w1 2>&1 | W | while IFS= read -r l; do echo "$(date +%T) $l"; done > $D/w1.txt
grep -E "ablate |captured|built|calibration graph|device model|Traceback|Error" $D/w1.txt | cut -c1-600
grep -A8 "Cost model vs" $D/w1.txt
date
