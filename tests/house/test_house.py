"""The house rules that keep the code readable in one sitting: no module over 500 lines and no
function over 80 lines, in replay/, kvcal/ and scenarios/ (templates are not Python and do not
count). Checked here so that a change that breaks them fails CI, not a later review."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("replay", "kvcal", "scenarios")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def sources(root: Path = ROOT) -> Iterator[Path]:
    for pkg in PACKAGES:
        yield from sorted((root / pkg).rglob("*.py"))


def long_modules(paths: Iterator[Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    out = []
    for path in paths:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{_name(path)}: {n} lines")
    return out


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions whose body, decorators and signature included, spans more than ``limit`` lines.
    A nested function counts inside its parent too: the parent is what a reader has to hold."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            n = (node.end_lineno or node.lineno) - first + 1
            if n > limit:
                out.append(f"{_name(path)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_no_module_is_over_500_lines() -> None:
    assert long_modules(sources()) == []


def test_no_function_is_over_80_lines() -> None:
    found = [line for path in sources() for line in long_functions(path)]
    assert found == []


@pytest.mark.parametrize("body_lines", [MAX_FUNCTION_LINES - 1, MAX_FUNCTION_LINES])
def test_the_function_rule_counts_what_a_reader_sees(tmp_path: Path, body_lines: int) -> None:
    """A function of exactly 80 lines passes, one of 81 fails: the check measures, not guesses."""
    body = "".join(f"    x{i} = {i}\n" for i in range(body_lines))
    path = tmp_path / "planted.py"
    path.write_text("@staticmethod\ndef planted():\n" + body, encoding="utf-8")
    found = long_functions(path)
    total = body_lines + 2  # decorator and signature
    assert (found != []) == (total > MAX_FUNCTION_LINES)


if __name__ == "__main__":  # python tests/house/test_house.py: what breaks the rules, one per line
    for line in long_modules(sources()) + [f for p in sources() for f in long_functions(p)]:
        print(line)
