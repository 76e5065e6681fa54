source benchmarks/probes/s19_common.sh
set -x
date
timeout 60 python -m pytest -q tests/gpu/test_profile_gpu.py -s -x -k "replay and llm" 2>&1 | W | tail -8
timeout 330 python benchmarks/ablate.py --model flux2 --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --pass cse --pass fp8 --pass fuse_qk_norm_rope --pass rowwise_fusion --pass fold_constants --out-dir $D/w2 2>&1 | W > $D/w2.txt
grep -E "ablate |captured|built|calibration graph|Traceback|Error" $D/w2.txt
grep -A8 "Cost model vs" $D/w2.txt
date
