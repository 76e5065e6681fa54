# the lines run1.sh, run2.sh and run3.sh each began with (after their first comment): the
# carried wheels installed, kopt registered as a dynamo backend, the clock and the tree recorded
export PYTHONUNBUFFERED=1
S=$(date +%s); T=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
mkdir -p /tmp/site/kopt-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: kopt\nVersion: 0.1.0\n' > /tmp/site/kopt-0.1.0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkopt = kopt.backend:kopt_backend\n' > /tmp/site/kopt-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD
left() { echo $(( T - ($(date +%s) - S) )); }
(nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv; git log -1 --format=%h; git status --short) > $OUT/gpu.txt 2>&1
