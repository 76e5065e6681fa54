source benchmarks/probes/s19_common.sh
set -x
date
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv
timeout 100 python -m pytest -q tests/gpu/test_profile_gpu.py -s -x 2>&1 | W | tail -25 > $D/profile_tests.txt
cat $D/profile_tests.txt
timeout ${W2_LIMIT:-440} python benchmarks/ablate.py --model flux2 --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --pass remove_noops --pass cse --pass merge_projections --pass fp8 --pass absorb_bias --pass fuse_qk_norm_rope --pass fuse_act_quant --pass fuse_act --pass rowwise_fusion --pass fold_constants --pass cat_rows --pass hoist --out-dir $D/w2 2>&1 | W > $D/w2.txt
grep -E "ablate |captured|built|calibration graph" $D/w2.txt
date
