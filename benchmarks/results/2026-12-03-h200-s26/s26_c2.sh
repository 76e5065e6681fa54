source benchmarks/probes/s26_common.sh
date
timeout 130 python -m pytest -q tests/gpu/test_foundation_gpu.py tests/gpu/test_structural_gpu.py tests/gpu/test_gqa_gpu.py 2>&1 | grep -v "^DEBUG\|^\s*$" | grep -E "^E  .*(Error|assert)|passed|failed|FAILED" | head -30
date
timeout 150 python -m benchmarks.probes.miss_in_step --model qwen-image --fp8 --without merge_projections --rounds 3 2>&1 | W | grep -v "^\s*$" | tail -30
date
REST=$(rest); DM=/tmp/c1/w1/device_model.json; [ -f $DM ] || DM=h200; [ -z "$REST" ] && REST="--pass merge_projections --pass hoist --pass fuse_act_quant --pass remove_noops"
echo "rest: $REST; device model $DM"
[ -n "$REST" ] && timeout 290 $A1 $REST --device-model $DM --out-dir $D/w1b 2>&1 | W | stamp > $D/w1b.txt
grep -E "ablate |Traceback|Error" $D/w1b.txt | cut -c1-330
date
