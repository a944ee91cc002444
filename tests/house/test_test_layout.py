"""tests/ mirrors the code: a unit test lives in the folder of the package it tests (the one it
imports from most), and every test module is in one of the kinds docs/development.md names."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

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


# Modules that build their inputs mostly with another package's code, so that package's imports
# outnumber those of the package they test: module -> the folder it lives in, and why.
BUILT_WITH_ANOTHER = {
    "present/test_report.py": "make_run_dir writes its run with the analysis's own summary, "
    "quality, systems and verdict code; the tests read the reports of it",
    "present/test_trend_report.py": "re-analyses make_run_dir's quality and verdict with the "
    "prompts' lengths; the tests read the trend in the reports and the terminal",
    "run/test_capacity_sizing.py": "the model's KV layout and the targets (serving) are the "
    "inputs of run.capacity_plan, which it tests",
    "run/test_capacity_skip.py": "builds the verdict's facts with the analysis's records; it "
    "tests whether the run (run.capacity_phase, run.capacity_step) starts the capacity phase",
    "run/test_error_budget.py": "drives the budget through the CLI's runs and reads their "
    "files; what it tests is run.budget and the runner's stop",
    "run/test_manifest.py": "reads back with the analysis's Manifest what the runner "
    "(run.runner, run.run_config) wrote",
    "run/test_streaming.py": "writes and reads its traces with replay.traces; it tests that "
    "the runner (run.runner, run.phase) never holds a whole trace",
    "run/test_workers.py": "reads the run directory (rundir) the load processes of "
    "run.worker_pool and run.load_process wrote",
    "run/test_systems_run.py": "drives interleaved runs (run.interleave) through the command "
    "line, in a subprocess; it reads back their manifests (rundir)",
    "run/test_too_long.py": "checks that a request too long for its target (run.phase) is "
    "counted apart by the summary (analysis) and not blamed on the target",
    "serving/test_scale_log.py": "reads the scale evidence of recorded vLLM logs "
    "(serving.scale_log); the verdict's serving-path check on them takes the analysis's "
    "records (TargetSummary, Manifest)",
}


def imported_packages(path: Path) -> dict[str, tuple[int, int]]:
    """Per package, how many ``from replay.<package>... import`` lines (``from kvcal...``:
    "kvcal") the module has, anywhere in it, and how many names they import; replay.core's are
    left out."""
    lines: Counter[str] = Counter()
    names: Counter[str] = Counter()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        parts = node.module.split(".")
        if parts[0] == "kvcal":
            package = "kvcal"
        elif parts[0] == "replay" and len(parts) > 1 and parts[1] != "core":
            package = parts[1]
        else:
            continue
        lines[package] += 1
        names[package] += len(node.names)
    return {p: (lines[p], names[p]) for p in lines}


def misplaced() -> dict[str, list[str]]:
    """Each unit test module not in the folder of a package it imports from most (by lines, then
    by names; a tie still left: any of them), with those packages. A module that imports only
    from replay.core belongs in core; one that imports nothing of replay or kvcal (it drives a
    run through tests/support) may live anywhere."""
    out = {}
    for path in sorted((TESTS / "unit").rglob("test_*.py")):
        counts = imported_packages(path)
        if not counts:
            uses_core = "from replay.core" in path.read_text(encoding="utf-8")
            homes = ["core"] if uses_core else [path.parent.name]
        else:
            most = max(counts.values())
            homes = sorted(p for p, n in counts.items() if n == most)
        if path.parent.name not in homes:
            out[path.relative_to(TESTS / "unit").as_posix()] = homes
    return out


def test_each_unit_test_lives_with_the_package_it_mostly_imports() -> None:
    """A test reaches the package it tests through ``from replay.<package>... import`` lines
    (or ``from kvcal...``), so the package named by most of them (a tie broken by the names
    they import) is its folder. replay.core is not counted: every package builds on it, and a
    test builds its inputs with it. The few modules whose input-building imports outnumber the
    tested package's are listed, with why, in ``BUILT_WITH_ANOTHER``; a listed module that no
    longer needs it fails too."""
    found = misplaced()
    wrong = {m: homes for m, homes in found.items() if m not in BUILT_WITH_ANOTHER}
    assert wrong == {}, (
        f"unit test modules outside the folder of the package they import most: {wrong}"
    )
    stale = sorted(set(BUILT_WITH_ANOTHER) - set(found))
    assert stale == [], f"BUILT_WITH_ANOTHER entries that now pass the rule (remove them): {stale}"
