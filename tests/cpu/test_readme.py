"""The README's two commands are what CI and newcomers run: keep them true. The README stays a
five-minute read, RESULTS.md's current figures stay short, runs are named by date and machine,
and the raw results kept are those the current figures cite."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
RAW = ROOT / "benchmarks" / "results"
# internal run labels a reader cannot map to a date and a machine
# run labels ("session" with a number or a possessive), spelled so that this line is none
LABEL = re.compile(r"sessions? [0-9]|session'[s]", re.IGNORECASE)


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("```")[0].strip().splitlines()[-1] for b in blocks]


def _current_section() -> list[str]:
    lines = RESULTS.read_text().splitlines()
    start = lines.index("## Current figures")
    end = next(i for i, line in enumerate(lines) if line.startswith("## History"))
    assert start < end
    return lines[start:end]


def test_ci_runs_the_readme_test_command() -> None:
    setup_and_run, setup_and_test = _commands()
    assert "kopt optimize" in setup_and_run and "torch==2.13.0" in setup_and_run
    assert "pytest" in setup_and_test and "torch==2.13.0" in setup_and_test
    assert setup_and_test in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readme_is_short_and_its_docs_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    named = set(re.findall(r"`(docs/[\w.-]+\.md)`", text))
    assert named, "the README points to docs/"
    assert all((ROOT / doc).is_file() for doc in named), sorted(named)


def test_results_current_figures_come_first_and_fit_in_300_lines() -> None:
    current = _current_section()
    assert len(current) <= 300
    # one table per topic, columns: claim, figure, date and machine, command
    headers = [line for line in current if line.startswith("| claim |")]
    assert headers and all("date, machine" in h for h in headers)


def test_runs_are_named_by_date_and_machine_not_by_internal_labels() -> None:
    docs = [ROOT / "README.md", RESULTS, *sorted((ROOT / "docs").glob("**/*.md"))]
    for doc in docs:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            assert not LABEL.search(line), f"{doc.relative_to(ROOT)}:{number}: {line}"
    run = re.compile(r"\d{4}-\d{2}-\d{2}-(h200|h200x2|h100|cpu)(-[a-z0-9]+)*")  # date-machine-what
    for folder in RAW.iterdir():
        assert run.fullmatch(folder.name), folder


def test_raw_results_are_the_cited_runs_and_stay_small() -> None:
    text = RESULTS.read_text()
    folders = sorted(p.name for p in RAW.iterdir() if p.is_dir())
    assert folders
    uncited = [name for name in folders if not re.search(re.escape(name) + r"[`/]", text)]
    assert not uncited, f"raw results no current figure cites: {uncited}"
    cited = set(re.findall(r"`(\d{4}-\d{2}-\d{2}-[a-z0-9-]+)[`/]", text))
    assert cited <= set(folders), f"cited but missing: {sorted(cited - set(folders))}"
    size = sum(p.stat().st_size for p in RAW.rglob("*") if p.is_file())
    assert size <= 3 * 2**20, f"benchmarks/results holds {size / 2**20:.1f} MiB"
