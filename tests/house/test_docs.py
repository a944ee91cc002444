"""docs/: the generated CLI and run-directory references are what the commands' help and the
records say now, and every relative link in the docs reaches a file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "docs"))


@pytest.mark.parametrize("script", ["cli_reference.py", "run_directory_reference.py"])
def test_a_generated_reference_is_current(script: str) -> None:
    """In a process of its own, as a user runs it: the page is what a fresh import of the
    commands' help (cli.md) or of the records (run-directory-reference.md) gives, whatever
    other tests did to this process."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / script), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_run_directory_reference_holds_every_file_and_nested_record() -> None:
    import run_directory_reference as ref

    text = ref.page()
    for heading in ("## manifest.json", "## results.jsonl", "## summary.json"):
        assert f"\n{heading}\n" in text
    for record in ("Manifest", "RunSpec", "Result", "Summary", "TargetSummary", "Percentiles"):
        assert f"\n### `{record}`\n" in text
    assert "| `first_token` | `float \\| None` | The first token of any kind" in text


def test_every_command_is_in_the_cli_reference() -> None:
    import cli_reference

    text = cli_reference.page()
    for command in ("replay canary", "replay trace anonymize", "kvcal emulate", "kvcal advise"):
        assert f"\n## {command}\n" in text


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (code blocks' comment lines are not ones)."""
    out, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.+?)\s*$", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_relative_links_in_the_readme_and_the_docs_reach_a_file_and_a_heading() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", text):
            where = (page.parent / target) if target else page
            if not where.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, broken


def test_the_readme_is_a_front_door() -> None:
    """The README: set-up, the commands, the verdict table and where to go next."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, len(lines)
