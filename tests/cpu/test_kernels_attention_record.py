"""benchmarks/kernels_attention.py --kb: the measured times go into the knowledge base, and a
case short of the bar an 8-bit attention must clear becomes a dead end with its cause."""

from __future__ import annotations

from benchmarks import kernels_attention as bench
from kopt.kb import KnowledgeBase


def _row(case: str, workload: str | None, cudnn: float, q8: float) -> bench.Row:
    row = bench.Row(case, (1, 24, 4224, 128), 219.0, workload=workload)
    row.us = {"sdpa-cudnn": cudnn, "q8-bf16": q8 * 1.1, "q8-fp8": q8}
    row.error = {"randn": {"sdpa-cudnn": 2.3e-3, "q8-bf16": 9.6e-3, "q8-fp8": 3.7e-2}}
    return row


def test_a_case_short_of_the_bar_is_a_dead_end_with_its_measured_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    path = tmp_path / "kb.sqlite"
    bench.record(str(path), [_row("W1 1024x1024", "W1", 351.5, 477.1),  # slower
                             _row("W2 1024x1024", "W2", 889.9, 600.0),  # 1.48x: clears the bar
                             _row("W1 512x512", None, 40.0, 60.0)])     # no workload's shape
    kb = KnowledgeBase.open(path)
    measured = kb.measurements()
    assert [(m.workload, m.rewrite) for m in measured] == [("W1", "attention_q8"),
                                                          ("W2", "attention_q8")]
    assert abs(measured[0].candidate_ms - 0.4771) < 1e-9
    device = "NVIDIA H100 80GB HBM3"
    dead = kb.dead_end("attention_q8", device, "W1")
    assert dead is not None and "0.74x its throughput" in dead.cause and "q8-fp8 3.7e-02" in \
        dead.cause
    assert kb.dead_end("attention_q8", device, "W2") is None
