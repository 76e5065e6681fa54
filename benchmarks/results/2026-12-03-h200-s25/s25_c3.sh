source benchmarks/probes/s25_common.sh
date
timeout 200 python -m benchmarks.probes.row_protocol --model qwen-image --fp8 --without merge_projections --rounds 6 2>&1 | W | grep -v "^\s*$" | tail -60
date
timeout 300 python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3 --pass merge_projections --out-dir $D/w1 > $D/w1.txt 2>&1
grep -E "^ablate |calibration graph|miss|Traceback|Error" $D/w1.txt | cut -c1-300
grep -B2 -A8 "leave-one-out, replayed" $D/w1.txt
date
