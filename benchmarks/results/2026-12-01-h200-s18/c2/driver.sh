source benchmarks/probes/s18_common.sh
set -x
date
timeout 200 python -m pytest -q tests/gpu/test_codegen_gemm_gpu.py 2>&1 | W > $D/tests_gemm.txt; tail -5 $D/tests_gemm.txt
date
python - > $D/inductor_cat.txt 2>&1 <<'PY'
import torch
from torch._inductor.utils import run_and_get_code
from benchmarks.kernels_cat import joint_v
for shape in ((128, 4096, 24, 128), (512, 4096, 48, 128)):
    a, b = joint_v(*shape)
    f = torch.compile(lambda a, b: torch.cat([a, b], 1), dynamic=False)
    _, code = run_and_get_code(f, a, b)
    print("=" * 30, shape)
    print(code[0])
PY
grep -n "def triton\|XBLOCK\|num_warps\|tl.load\|tl.store\|grid" $D/inductor_cat.txt | head -40
date
timeout 280 python -m benchmarks.kernels_gemm --sweep --case txt --case modulation --out $D/sweep_split.json 2>&1 | W > $D/sweep_split.txt; tail -12 $D/sweep_split.txt
date
