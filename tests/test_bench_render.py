"""docs/benchmarks.md as `python -m bench` rewrites it: a suite run alone keeps the others."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"


@pytest.fixture
def render(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench.render, from the checkout (bench is not installed with edgecache)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import render

    return render


def _sections(text: str) -> list[str]:
    return [c for c in re.split(r"(?m)^(?=## )", text) if c.startswith("## ")]


def test_rendering_without_a_suites_results_keeps_its_section_and_rows(
    tmp_path: Path, render: ModuleType
) -> None:
    """`python -m bench --only planner` (the docs' way to refresh one section) rewrote the
    page with the planner's section alone: every other section and summary row deleted, and
    `--render-only` in a fresh clone (no build/bench) emptied it (a helper's hunt)."""
    page = tmp_path / "benchmarks.md"
    shutil.copy(DOCS, page)
    render.write_docs({}, page)
    before, after = DOCS.read_text(), page.read_text()
    assert _sections(after)[1:] == _sections(before)[1:]  # the summary's rows: below
    rows = {line for line in before.splitlines() if re.match(r"\| [a-z]+ \| ", line)}
    assert rows and rows <= set(after.splitlines())


def test_every_suites_heading_is_on_the_page(render: ModuleType) -> None:
    """The headings a kept section is found by are the ones the sections are written with."""
    headings = [c.splitlines()[0] for c in _sections(DOCS.read_text())]
    for suite, heading in render._HEADINGS.items():  # noqa: SLF001
        assert sum(h.startswith(heading) for h in headings) == 1, (suite, heading)


def test_render_only_without_results_and_a_docs_folder_that_is_not_there_are_refused(
    tmp_path: Path,
) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("# kept\n")
    for args, said in (
        (["--render-only", "--out", str(tmp_path / "none"), "--docs", str(page)], "no results"),
        (["--only", "planner", "--docs", str(tmp_path / "nodir" / "b.md")], "does not exist"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "bench", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert out.returncode == 2 and said in out.stderr, (args, out.stdout, out.stderr)
    assert page.read_text() == "# kept\n"


def test_a_skipped_gpu_run_keeps_a_gpu_hosts_section_and_fresh_sections_are_dated(
    tmp_path: Path, render: ModuleType
) -> None:
    """bench.gpu without CUDA measures nothing: a make bench on a CPU machine replaced a GPU
    host's section with "Not run here". Five sections carried no date, so a kept one could
    not be told from a fresh one (a review)."""
    page = tmp_path / "benchmarks.md"
    text = DOCS.read_text()
    at = text.index("## GPU")
    page.write_text(text[:at] + "## GPU (`python -m bench.gpu`)\n\nFIGURES FROM A GPU HOST\n")
    render.write_docs({"gpu": {"skipped": "no CUDA device here", "_date": "2026-12-07"}}, page)
    assert "FIGURES FROM A GPU HOST" in page.read_text()
    assert render._dated("## X\n\nbody", "x", {"_date": "2026-12-07"}).startswith(  # noqa: SLF001
        "## X\n\nMeasured 2026-12-07 (`python -m bench --only x`)."
    )
    fresh = tmp_path / "fresh.md"
    render.write_docs({"gpu": {"skipped": "no CUDA device here", "_date": "2026-12-07"}}, fresh)
    assert "Measured 2026-12-07" in fresh.read_text()  # no section to keep: the skip, dated
