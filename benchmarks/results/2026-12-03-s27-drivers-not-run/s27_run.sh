# usage: bash benchmarks/probes/s27_run.sh C   (runs s27_C.sh on the one GPU; results in $OUT/C.tgz)
C=$1
mkdir -p /tmp/$C
python -m pip install -q --no-deps --target /tmp/site .whl/*.whl > /tmp/$C/setup.txt 2>&1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >> /tmp/$C/setup.txt 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -l 1 > /tmp/$C/clocks.csv 2>&1 &
SMI=$!
nvidia-smi --query-gpu=timestamp,clocks_event_reasons.active,clocks_event_reasons.sw_power_cap,clocks_event_reasons.sw_thermal_slowdown,clocks_event_reasons.hw_slowdown,temperature.gpu --format=csv -l 1 > /tmp/$C/reasons.csv 2>&1 &
SMI2=$!
source benchmarks/probes/s27_common.sh
D=/tmp/$C timeout ${LIMIT:-540} bash benchmarks/probes/s27_$C.sh > /tmp/$C/log.txt 2>&1
echo "rc=$?" >> /tmp/$C/log.txt
kill $SMI $SMI2
tar czf $OUT/$C.tgz -C /tmp $C
tail -30 /tmp/$C/log.txt
