#!/bin/bash
# W1 FP8 on one machine: the backend with its blocks compiled once per kind (regional), cold and
# warm with copies ahead (new) and a warm start without (old), the GPU suite, then what time is
# left: the backend flat and a cold start without copies ahead.
export PYTHONUNBUFFERED=1
S=$(date +%s); T=$1
ls /tmp/site/torchao >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl dev/fp8attn/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
git log -1 --format=%h > $OUT/code.txt 2>/dev/null; git status --short >> $OUT/code.txt 2>/dev/null
left() { echo $(( T - ($(date +%s) - S) )); }
backend() {  # $1: regional | flat
  rm -rf /tmp/rb_$1.kb /tmp/tcb_$1
  if [ $1 = flat ]; then export KOPT_FLAT=1; else unset KOPT_FLAT; fi
  TRITON_CACHE_DIR=/tmp/tcb_$1 timeout $2 python dev/abrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/rb_$1.kb --backend inductor > $OUT/w1_backend_$1.txt 2>&1; echo "rc $?" >> $OUT/w1_backend_$1.txt
  unset KOPT_FLAT
  grep "^variant\|^qwen-image: \|^rc\|inner comp" $OUT/w1_backend_$1.txt | cut -c1-300
}
cold() {  # $1: new | old
  rm -rf /tmp/r_$1.kb /tmp/tc_$1
  KOPT_TRITON_LOG=1 KOPT_AB=$1 TRITON_CACHE_DIR=/tmp/tc_$1 timeout 110 python dev/abrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_$1.kb > $OUT/w1_cold_$1.txt 2>&1; echo "rc $?" >> $OUT/w1_cold_$1.txt
  grep "^variant\|until the\|ahead\|^rc\|peak" $OUT/w1_cold_$1.txt | cut -c1-200
}
warm() {  # $1: new | old, $2: the knowledge base's variant
  KOPT_AB=$1 TRITON_CACHE_DIR=/tmp/tc_$2 timeout 60 python dev/abrun.py --model qwen-image --device cuda --fp8 --verify 1 --kb /tmp/r_$2.kb > $OUT/w1_warm_$1_$3.txt 2>&1; echo "rc $?" >> $OUT/w1_warm_$1_$3.txt
  grep "^variant\|until the\|ahead\|^rc\|peak" $OUT/w1_warm_$1_$3.txt | cut -c1-200
}
cudnn() {
  timeout $1 python dev/fp8attn/cudnn_fp8.py --out $OUT/cudnn_fp8.json --budget-s $(( $1 - 25 )) > $OUT/cudnn_fp8.txt 2>&1; echo "rc $?" >> $OUT/cudnn_fp8.txt
  tail -n 14 $OUT/cudnn_fp8.txt | cut -c1-250
}
L=$(( $(left) - 330 )); [ $L -gt 200 ] && L=200; echo "suite gets $L s"
timeout $L python -m pytest tests/gpu -q -rf -n 8 -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "rc $?" >> $OUT/gpu_tests.txt
grep -v "^  \|Warn" $OUT/gpu_tests.txt | tail -12 | cut -c1-300
L=$(left); echo "left $L s"; [ $L -gt 100 ] && backend regional $(( L - 5 < 150 ? L - 5 : 150 ))
L=$(left); echo "left $L s"; [ $L -gt 75 ] && cold new
L=$(left); echo "left $L s"; [ $L -gt 40 ] && warm new new 1
L=$(left); echo "left $L s"; [ $L -gt 60 ] && cudnn $(( L - 5 < 110 ? L - 5 : 110 ))
L=$(left); echo "left $L s"; [ $L -gt 40 ] && warm old new 1
L=$(left); echo "left $L s"; [ $L -gt 125 ] && backend flat $(( L - 10 ))
L=$(left); if [ $L -gt 80 ]; then warm new new 2; warm old new 2; fi
