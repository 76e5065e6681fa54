"""Record cudnn_fp8.py's rows in a knowledge base: each W1/W2 case's FP8 attention time against
cuDNN BF16 as a micro measurement of ``attention_fp8_cudnn``, and the dead end with its measured
cause (the bar: 1.35x cuDNN BF16's throughput, quantizers included).

    python record_kb.py cudnn_fp8.json KB && kopt kb export --kb KB > kb_export.md"""
import json
import sys

from kopt.kb import KnowledgeBase

BAR = 1.35
rows = json.load(open(sys.argv[1]))
kb = KnowledgeBase.open(sys.argv[2])
for w in ("W1", "W2"):
    mine = [r for r in rows if r["workload"] == w]
    device = mine[0]["env"]["device"]
    base = max(r["us"]["bf16_cudnn"] for r in mine)
    attn = min(r["us"]["fp8_attn"] for r in mine)
    total = min(r["us"]["fp8_total"] for r in mine)
    fused = min(r["us"]["fp8_total_fused_quant_estimate"] for r in mine)
    kb.record_measurement("micro", w, device, base / 1e3, total / 1e3, rewrite="attention_fp8_cudnn",
                          note=f"cuDNN sdpa_fp8 with torch's quantizers against cuDNN BF16 SDPA, {mine[0]['case']}")
    errs = "; ".join(f"{r['kind']}: fp8 {float(r['error']['fp8']):.2e}, q k v rounded alone "
                     f"{float(r['error']['floor_qkv_e4m3_only']):.2e}, bf16 {float(r['error']['bf16_cudnn']):.2e}"
                     for r in mine)
    kb.record_verdict(
        "attention_fp8_cudnn", "dead_end", workload=w, device=device, origin="human",
        tags=("slower", "numerics"),
        cause=f"{mine[0]['case']}: cuDNN's sdpa_fp8 (cudnn-frontend 1.32.0, cuDNN 9.19; e4m3 q, k, v, "
              f"P and O with per-tensor scales, BF16 O being Blackwell-only) {attn:.0f} us alone, "
              f"{total:.0f} us with q, k, v quantized and O dequantized, {fused:.0f} us estimated "
              f"with one fused cast and amax, against cuDNN BF16's {base:.0f} us: "
              f"{base / attn:.2f}x / {base / total:.2f}x / {base / fused:.2f}x its throughput where "
              f"{BAR}x is the bar; error against fp64 {errs}")
