source benchmarks/probes/s26_common.sh
date
timeout 550 $A1 $(for p in $W1P; do echo --pass $p; done) --out-dir $D/w1 2>&1 | W | stamp > $D/w1.txt
grep -E "ablate |captured|calibration graph|Traceback|Error" $D/w1.txt | cut -c1-330
grep -A8 "Cost model vs" $D/w1.txt
date
