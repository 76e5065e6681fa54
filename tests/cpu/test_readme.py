"""The README's two commands are what CI and newcomers run: keep them true."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("```")[0].strip().splitlines()[-1] for b in blocks]


def test_ci_runs_the_readme_test_command() -> None:
    setup_and_run, setup_and_test = _commands()
    assert "kopt optimize" in setup_and_run and "torch==2.13.0" in setup_and_run
    assert "pytest" in setup_and_test and "torch==2.13.0" in setup_and_test
    assert setup_and_test in (ROOT / ".ci" / "run").read_text().splitlines()
