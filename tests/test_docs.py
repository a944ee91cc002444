"""docs/: the generated CLI reference is what the commands' help says now, and every relative
link in the docs reaches a file."""

from __future__ import annotations

import re
import sys

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "docs"))


def test_the_cli_reference_is_current() -> None:
    import cli_reference

    assert cli_reference.PAGE.read_text(encoding="utf-8") == cli_reference.page(), (
        "run: python docs/cli_reference.py"
    )


def test_every_command_is_in_the_cli_reference() -> None:
    import cli_reference

    text = cli_reference.page()
    for command in ("replay canary", "replay trace anonymize", "kvcal emulate", "kvcal advise"):
        assert f"\n## {command}\n" in text


def test_relative_links_in_the_docs_reach_a_file() -> None:
    broken = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
