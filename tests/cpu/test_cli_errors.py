"""Bad input to the command line: one error line naming the option, the problem and what would be
valid, exit code 2, no traceback; each refused before any model is optimized (except --explain,
whose names come from the captured graph)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kopt.cli import main
from tests.fixtures import QKV

QKV_MODEL = "tests.cpu.test_cli:qkv_workload"


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``kopt argv``; check it exits 2 with one error line last on stderr and no traceback;
    return that line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


def tensor_not_tuple() -> tuple:
    return QKV().eval(), torch.randn(2, 37)  # (model, x) instead of (model, (x,))


@pytest.fixture
def afile(tmp_path: Path) -> Path:
    """A plain file where a folder is expected."""
    path = tmp_path / "afile"
    path.write_text("")
    return path


@pytest.mark.parametrize(("argv", "says"), [
    (["--model", "os:path"], "--model os:path: os.path is a module, not a function returning"),
    (["--model", "os:sep"], "os.sep is a str, not a function"),
    (["--model", "os:getcwd"], "--model os:getcwd returned a str; it must return a "
                               "kopt.models.Workload or (model, args[, kwargs])"),
    (["--model", "kopt.models:build"], "kopt calls it with no arguments, but missing a "
                                       "required argument: 'name'"),
    (["--model", ":fn"], "--model ':fn': expected module:function"),
    (["--model", "tests.cpu.test_cli_errors:tensor_not_tuple"],
     "returned (model, Tensor, ...): args must be a tuple, e.g. (model, (x,))"),
    (["--model", QKV_MODEL, "--shape", "height=64"], f"{QKV_MODEL} makes its own"),
])
def test_model_that_is_no_workload_builder(argv: list[str], says: str, capsys) -> None:  # noqa: ANN001
    assert says in _error(["optimize", "-q", *argv], capsys)


@pytest.mark.parametrize(("argv", "says"), [
    (["--device", "tpu"], "--device 'tpu': not a device; valid: cpu, cuda, cuda:N"),
    (["--device", ""], "--device '': not a device"),
    (["--device", "mps"], "--device mps: kopt runs on cpu or cuda (cuda:N)"),
    (["--device", "meta"], "kopt runs on cpu or cuda"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from 'bf16'"),
])
def test_unknown_device_or_dtype(argv: list[str], says: str, capsys) -> None:  # noqa: ANN001
    assert says in _error(["optimize", "-q", *argv], capsys)


def test_cuda_without_cuda(capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("optimize", "profile", "ablate"):
        line = _error([command, "-q", "--device", "cuda"], capsys)
        assert "--device cuda: CUDA is not available" in line and "use --device cpu" in line


def test_cuda_device_index_and_bf16_the_gpu_lacks(capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "--device cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1" in _error(
        ["optimize", "-q", "--device", "cuda:2"], capsys)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    assert "--dtype bf16: Tesla V100 has no bfloat16 support; use fp16 or fp32" in _error(
        ["optimize", "-q", "--device", "cuda:1", "--dtype", "bf16"], capsys)


QWEN_KEYS = "valid keys: height, width, text_tokens, batch, text_padding"


@pytest.mark.parametrize(("argv", "says"), [
    (["--shape", "foo=3"], f"--shape: unknown key 'foo' for model qwen-image-tiny; {QWEN_KEYS}"),
    (["--shape", "foo"], f"--shape expects KEY=VALUE, got 'foo'; {QWEN_KEYS}"),
    (["--shape", "=3"], "--shape expects KEY=VALUE, got '=3'"),
    (["--shape", "height="], "--shape expects KEY=VALUE, got 'height='"),
    (["--shape", "height=abc"], "--shape height=abc: height takes an integer"),
    (["--shape", "height=0"], "height must be at least 1, got 0"),
    (["--shape", "height=-16"], "height must be at least 1, got -16"),
    (["--shape", "batch=0"], "batch must be at least 1, got 0"),
    (["--shape", "text_tokens=0"], "text_tokens must be at least 1, got 0"),
    (["--model", "flux2-tiny", "--shape", "text_padding=1"],
     "unknown key 'text_padding' for model flux2-tiny; valid keys: height, width, text_tokens, "
     "batch"),
    (["--model", "llm-tiny", "--shape", "mode=foo"], "--shape mode=foo: mode is one of prefill, "
                                                     "decode"),
    (["--model", "llm-tiny", "--shape", "seq_len=0"], "seq_len must be at least 1, got 0"),
    (["--model", "llm-tiny", "--shape", "batch=abc"], "--shape batch=abc: batch takes an integer"),
])
def test_bad_shape(argv: list[str], says: str, capsys) -> None:  # noqa: ANN001
    assert says in _error(["optimize", "-q", *argv], capsys)


@pytest.mark.parametrize(("argv", "says"), [
    (["optimize", "--bench", "-3"], "--bench must be at least 0, got -3"),
    (["optimize", "--seeds", "0"], "--seeds must be at least 1, got 0"),
    (["optimize", "--fp8", "--fp8-min-features", "-5"], "--fp8-min-features must be at least 0"),
    (["optimize", "--fp8-layout", "foo"], "argument --fp8-layout: invalid choice: 'foo'"),
    (["optimize", "--disable", "nope"], "argument --disable: invalid choice: 'nope'"),
    (["optimize", "--enable", "hoist"], "argument --enable: invalid choice: 'hoist' (choose "
                                        "from 'gemm_epilogue'"),
    (["profile", "--iters", "0"], "--iters must be at least 1, got 0"),
    (["profile", "--top", "0"], "--top must be at least 1, got 0"),
    (["ablate", "--iters", "0"], "--iters must be at least 1, got 0"),
    (["ablate", "--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["ablate", "--steady", "-1"], "--steady must be at least 0, got -1.0"),
])
def test_bad_numbers_and_choices(argv: list[str], says: str, capsys) -> None:  # noqa: ANN001
    assert says in _error([*argv, "-q"], capsys)


def test_explain_an_unknown_node_names_close_ones(capsys) -> None:  # noqa: ANN001
    line = _error(["optimize", "-q", "--no-verify", "--model", QKV_MODEL, "--explain", "nrom"],
                  capsys)
    assert "--explain nrom: no node or module of that name in the captured graph; close: " \
        "norm" in line
    assert "--dump lists its nodes" in _error(
        ["optimize", "-q", "--no-verify", "--model", QKV_MODEL, "--explain", "nosuchnode"],
        capsys)


def test_unwritable_outputs(tmp_path: Path, afile: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    cases = [
        (["optimize", "--dump", str(afile)], f"--dump {afile}: exists and is not a folder"),
        (["optimize", "--dump", str(afile / "sub")], f"{afile} is not a folder"),
        (["optimize", "--kb", str(afile / "sub" / "kb.sqlite")], f"{afile} is not a folder"),
        (["optimize", "--kb", str(tmp_path)], f"--kb {tmp_path}: is a folder; give a file name"),
        (["profile", "--json", str(tmp_path / "no" / "x.json")],
         f"--json {tmp_path / 'no' / 'x.json'}: no folder {tmp_path / 'no'}"),
        (["profile", "--trace", str(afile / "t.json")], f"{afile} is not a folder"),
        (["profile", "--json", str(tmp_path)], "is a folder; give a file name"),
        (["ablate", "--md", str(tmp_path / "no" / "x.md")], "no folder"),
        (["ablate", "--png", str(afile / "x.png")], f"{afile} is not a folder"),
    ]
    for argv, says in cases:
        assert says in _error([*argv, "-q"], capsys), argv
    monkeypatch.setattr("kopt.cli.os.access", lambda path, mode: False)
    assert f"--dump {tmp_path / 'd'}: not writable" in _error(
        ["optimize", "-q", "--dump", str(tmp_path / "d")], capsys)


def test_png_without_matplotlib(tmp_path: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "--png needs matplotlib" in _error(
        ["ablate", "-q", "--png", str(tmp_path / "w.png")], capsys)


def test_bad_device_model(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    files = {"bad.json": '{"name": "x"', "fields.json": '{"name": "x", "bogus": 1}',
             "list.json": "[1, 2]"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = [
        ("nosuch", "--device-model 'nosuch': not auto, fit, a known device (h200, h100) or a JSON"),
        (str(tmp_path / "missing.json"), "a known device (h200, h100) or a JSON file"),
        (str(tmp_path / "bad.json"), "not a DeviceModel: Expecting ',' delimiter"),
        (str(tmp_path / "fields.json"), "not a DeviceModel: unknown fields bogus; missing "
                                        "fields bandwidth_gbs, peak_tflops (a DeviceModel has"),
        (str(tmp_path / "list.json"), "not a DeviceModel: a DeviceModel is a JSON object, got "
                                      "a list"),
    ]
    for choice, says in cases:
        assert says in _error(["optimize", "-q", "--rank", "--device-model", choice], capsys)


@pytest.mark.parametrize(("argv", "says"), [
    (["--rank-at", "seq_len=64"], "--rank-at predicts with the cost model of --rank; add --rank"),
    (["--rank", "--rank-at", "foo"], "--rank-at expects KEY=VALUE, got 'foo'; valid keys: mode, "
                                     "batch, seq_len, max_cache_len"),
    (["--rank", "--rank-at", "foo=3"], "--rank-at: unknown key 'foo' for model llm-tiny"),
    (["--rank", "--rank-at", "seq_len=abc"], "--rank-at seq_len=abc: seq_len takes an integer"),
    (["--rank", "--rank-at", "seq_len=0"], "--rank-at seq_len=0: seq_len must be at least 1"),
    (["--rank", "--rank-at", "seq_len=64,"], "--rank-at expects KEY=VALUE, got ''"),
])
def test_bad_rank_at(argv: list[str], says: str, capsys) -> None:  # noqa: ANN001
    assert says in _error(["optimize", "-q", "--model", "llm-tiny", *argv], capsys)


def test_rank_at_needs_a_reference_model(capsys) -> None:  # noqa: ANN001
    assert "--rank-at needs a reference model" in _error(
        ["optimize", "-q", "--model", QKV_MODEL, "--rank", "--rank-at", "height=64"], capsys)


def test_kb_commands(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    kb = ["--kb", str(tmp_path / "kb.sqlite")]
    assert f"kopt kb: error: no entry K1: no knowledge base at {tmp_path / 'kb.sqlite'} yet" \
        in _error(["kb", "show", "K1", *kb], capsys)
    assert main(["kb", "lesson", "measure twice", *kb]) == 0
    capsys.readouterr()
    cases = [
        (["show", "K999"], "kopt kb: error: no entry K999 in"),
        (["show", "foo"], "entry id 'foo': K<n> (kernel), M<n> (measurement)"),
        (["export", "--out", str(tmp_path / "no" / "x.md")],
         f"--out {tmp_path / 'no' / 'x.md'}: cannot write: No such file or directory"),
        (["export", "--out", str(tmp_path)], "cannot write: Is a directory"),
        (["prune", "--older-than", "-1"], "--older-than must be at least 0 days, got -1"),
        (["mark", "nosuchpass", "dead_end"], "unknown rewrite 'nosuchpass' (a verdict applies to "
                                             "a pass); valid: remove_noops,"),
        (["mark", "hoist", "nope"], "argument verdict: invalid choice: 'nope'"),
    ]
    for argv, says in cases:
        assert says in _error(["kb", *argv, *kb], capsys), argv
