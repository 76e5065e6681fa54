"""The kopt command line: the README's first command, errors with exit code 2, explain, dumps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kopt.cli import main
from tests.fixtures import QKV


def test_default_command_prints_the_report(capsys) -> None:  # noqa: ANN001
    assert main(["optimize", "-q"]) == 0
    out = capsys.readouterr().out
    assert "optimizing qwen-image-tiny" in out
    assert "transformer_blocks.0.attn.{to_q,to_k,to_v}" in out
    assert "transformer_blocks.1.attn.{add_q_proj,add_k_proj,add_v_proj}" in out
    assert "verification passed" in out


def test_unknown_model_and_bad_arguments_exit_2(capsys) -> None:  # noqa: ANN001
    assert main(["optimize", "--model", "nope", "-q"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["optimize", "--shape", "height", "-q"]) == 2
    assert main(["optimize", "--model", "no_such_module:fn", "-q"]) == 2
    proc = subprocess.run([sys.executable, "-m", "kopt.cli", "optimize", "--disable", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def qkv_workload() -> tuple:
    return QKV().eval(), (torch.randn(2, 37),)


def test_module_function_explain_and_dump(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    code = main(["optimize", "--model", "tests.cpu.test_cli:qkv_workload", "-q",
                 "--explain", "out", "--explain", "k", "--dump", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "explain out" in out and "no other projection reads its input" in out
    assert "explain k" in out and "rewritten in site" in out
    dumped = sorted(p.name for p in tmp_path.iterdir())
    assert dumped[0] == "00_captured.py"
    assert any(d.endswith("_merge_projections.py") for d in dumped)
    rule = (tmp_path / "patterns" / "merge_projections.txt").read_text()
    assert "x@Wq, x@Wk, x@Wv -> split(x@[Wq;Wk;Wv])" in rule and "tolerance" in rule


def test_disable_turns_a_pass_off(capsys) -> None:  # noqa: ANN001
    assert main(["optimize", "--model", "llm-tiny", "--disable", "merge_projections", "-q"]) == 0
    out = capsys.readouterr().out
    assert "merge_projections" not in out.split("kopt report")[1]


def test_enable_turns_on_a_pass_that_is_off_by_default(capsys) -> None:  # noqa: ANN001
    assert main(["optimize", "--model", "llm-tiny", "--fp8", "--fp8-min-features", "16",
                 "--enable", "gemm_epilogue", "-q"]) == 0
    report = capsys.readouterr().out.split("kopt report")[1]
    assert "gemm_epilogue" in report
    assert main(["optimize", "--enable", "gemm_epilogue", "--disable", "gemm_epilogue"]) == 2
    assert "both --enable and --disable" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # on by default: nothing to enable
        main(["optimize", "--enable", "hoist"])


def test_full_size_model_on_a_small_machine_is_refused_with_numbers(capsys, monkeypatch) -> None:  # noqa: ANN001, E501
    # Qwen-Image's 20.4B parameters in fp32 (~76 GiB) on a machine with 24 GiB free: exit 2
    # with the numbers, instead of being killed while allocating
    import kopt.models

    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 24 * 2**30 // 4096}
    monkeypatch.setattr(kopt.models.os, "sysconf", lambda key: pages[key])
    assert main(["optimize", "--model", "qwen-image", "-q"]) == 2
    err = capsys.readouterr().err
    assert "76.1 GiB for its weights" in err and "24.0 GiB free" in err and "-tiny" in err


def test_bench_prints_model_and_kopt_times(capsys) -> None:  # noqa: ANN001
    assert main(["optimize", "--model", "llm-tiny", "-q", "--bench", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3] == "time per call on cpu, median of 5 (the rows timed in turn, call by call):"
    assert lines[-2].startswith("  model, eager: ") and "(1.000x" in lines[-2]
    assert lines[-1].startswith("  kopt, --cuda-graphs auto (CUDA graphs: off (the inputs are "
                                "not on a CUDA device)): ")
    ratio = float(lines[-1].rsplit("(", 1)[1].split("x ")[0])
    assert 0 < ratio < 10


def test_median_ms_runs_warmup_and_timed_calls() -> None:
    from kopt.bench import median_ms

    calls = []
    ms = median_ms(lambda: calls.append(torch.ones(100).sum()), iters=5, warmup=2)
    assert len(calls) == 7 and ms > 0


def test_cuda_graphs_flag_says_it_has_no_effect_on_the_cpu(capsys) -> None:  # noqa: ANN001
    assert main(["optimize", "-q", "--no-verify", "--cuda-graphs", "--bench", "2"]) == 0
    out = capsys.readouterr()
    assert "--cuda-graphs has no effect on cpu" in out.err
    assert "kopt, --cuda-graphs on (CUDA graphs: off (the inputs are not on a CUDA " \
           "device)): " in out.out
    # with --no-verify nothing was checked, and the summary must not claim otherwise
    assert "verification off (nothing was checked)" in out.out and "passed" not in out.out
