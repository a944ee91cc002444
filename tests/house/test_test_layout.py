"""tests/ mirrors the code: a unit test lives in the folder of the package it tests, and every
test module is in one of the kinds docs/development.md names."""

from __future__ import annotations

from tests.conftest import ROOT

TESTS = ROOT / "tests"
KINDS = {"unit", "integration", "hostile", "house"}


def test_every_test_module_is_in_a_kind_of_test() -> None:
    stray = [
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("test_*.py")
        if p.relative_to(TESTS).parts[0] not in KINDS
    ]
    assert stray == [], f"test modules outside {sorted(KINDS)}: {stray}"


def test_each_unit_folder_is_a_package_of_the_code() -> None:
    packages = {p.name for p in (ROOT / "replay").iterdir() if (p / "__init__.py").exists()}
    packages.add("kvcal")
    folders = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= packages, f"unit test folders with no package: {sorted(folders - packages)}"
    assert all((TESTS / "unit" / f / "__init__.py").exists() for f in folders)
