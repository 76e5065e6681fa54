export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W() { grep -v -E "Warning|_warn_once|warnings.warn|return cls.__new__|^W1130|^W1201|^W1202|^W1203|^W1204"; }
W1P="merge_projections hoist absorb_bias fp8 cse fuse_qk_norm_rope remove_noops fuse_act_quant rowwise_fusion"
A1="python benchmarks/ablate.py --model qwen-image --fp8 --disable fuse_allreduce_norm --kind leave-one-out --seeds 0 --iters 5 --warmup 2 --profile-iters 3"
# the W1 passes whose leave-one-out row no earlier call's log holds
rest() { local r=""; for p in $W1P; do cat /tmp/c*/w1*.txt 2>/dev/null | grep -q "ablate all - $p:" || r="$r --pass $p"; done; echo "$r"; }
stamp() { while IFS= read -r l; do echo "$(date +%T) $l"; done; }
