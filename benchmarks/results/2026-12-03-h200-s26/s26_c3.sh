source benchmarks/probes/s26_common.sh
date
timeout 380 python benchmarks/ablate.py --model flux2 --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --pass fuse_qk_norm_rope --pass rowwise_fusion --pass fp8 --pass fuse_act_quant --out-dir $D/w2 2>&1 | W | stamp > $D/w2.txt
grep -E "ablate |captured|calibration graph|Traceback|Error" $D/w2.txt | cut -c1-330
grep -A8 "Cost model vs" $D/w2.txt
date
REST=$(rest); DM=/tmp/c1/w1/device_model.json; [ -f $DM ] || DM=h200
echo "rest: $REST; device model $DM"
[ -n "$REST" ] && timeout 160 $A1 $REST --device-model $DM --out-dir $D/w1c 2>&1 | W | stamp > $D/w1c.txt
grep -E "ablate |Traceback|Error" $D/w1c.txt 2>/dev/null | cut -c1-330
date
