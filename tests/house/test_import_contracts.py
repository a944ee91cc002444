"""The import contracts in pyproject.toml ([tool.importlinter]) hold, and they bite: a wrong-way
import planted in a copy of the tree breaks them."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter comes with the dev extra")

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over the packages under ``root``, with root's pyproject.toml."""
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else ["lint-imports"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [*cmd, "--no-cache"], cwd=root, env=env, text=True, capture_output=True, timeout=300
    )


def copy_tree(dst: Path) -> Path:
    for pkg in ("replay", "kvcal"):
        shutil.copytree(
            ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "models", "*.j2")
        )
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def plant(path: Path, line: str) -> None:
    text = path.read_text(encoding="utf-8")
    head, sep, rest = text.partition("from __future__ import annotations\n")
    assert sep, f"{path} has no __future__ import to plant after"
    path.write_text(head + sep + line + "\n" + rest, encoding="utf-8")


def test_the_tree_keeps_its_contracts() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("replay/core/errors.py", "import replay.cli", "layers"),
        ("replay/serving/sse.py", "from replay.analysis import stats", "layers"),
        ("replay/traces/trace.py", "import torch", "import no heavy dependency"),
        ("replay/checkers/text.py", "import locust", "import no heavy dependency"),
        ("replay/core/records.py", "import replay.checkers", "layers"),
        ("replay/checkers/base.py", "import replay.traces", "layers"),
        ("replay/run/runner.py", "import kvcal", "kvcal may import replay"),
        ("replay/run/budget.py", "import replay.run.runner", "no import cycles"),
        ("replay/checkers/base.py", "import replay.checkers.grader", "no import cycles"),
        ("replay/cli/common.py", "import replay.tools.pii._reading", "a private module"),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    root = copy_tree(tmp_path)
    plant(root / module, line)
    done = lint_imports(root)
    assert done.returncode != 0, done.stdout
    broken = [ln for ln in done.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(contract in ln for ln in broken), done.stdout


# --- what import-linter does not see: the scripts of bench/ and scenarios/, private names ----


def _module_name(path: Path, top: Path) -> str:
    """bench/tables.py -> tables (bench's scripts import each other by bare name, run from
    bench/); scenarios/kvc/run.py -> kvc.run (the locustfile's folder is on the path)."""
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top: Path, known: set[str]) -> Iterator[tuple[str, str]]:
    """(module, name) for every import in ``path`` (at any depth, lazy ones too) of a module
    among ``known``; ``name`` is what a ``from`` import takes from it."""
    me = _module_name(path, top)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((a.name, "") for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*filter(None, up), *filter(None, [node.module])])
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    yield f"{base}.{a.name}", ""
                elif base in known:
                    yield base, a.name


def _graph(top: Path, files: list[Path]) -> dict[str, set[str]]:
    known = {_module_name(f, top) for f in files}
    return {
        _module_name(f, top): {m for m, _ in _imports(f, top, known)} - {_module_name(f, top)}
        for f in files
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` (a list of modules, the first repeated at the end)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


@pytest.mark.parametrize("folder", ["bench", "scenarios"])
def test_the_scripts_have_no_import_cycle(folder: str) -> None:
    top = ROOT / folder
    graph = _graph(top, sorted(top.rglob("*.py")))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_a_private_name_of_another_package() -> None:
    """``from x.y import _name`` only within x.y's own package: a private name is its package's
    business (tests may reach into what they test)."""
    found = []
    for folder in ("replay", "kvcal", "scenarios", "bench"):
        top = ROOT if folder in ("replay", "kvcal") else ROOT / folder
        files = sorted((ROOT / folder).rglob("*.py"))
        known = {_module_name(f, top) for f in files}
        for f in files:
            me = _module_name(f, top)
            package = me if f.name == "__init__.py" else me.rpartition(".")[0]
            for module, name in _imports(f, top, known):
                private = name.startswith("_") and not name.startswith("__")
                if private and module.rpartition(".")[0] != package and module != package:
                    found.append(f"{f.relative_to(ROOT)}: {module}.{name}")
    assert not found, found
