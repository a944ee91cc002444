"""The run's clock is a protocol (``replay.core.schedule.Clock``), and ``MonotonicClock`` is one
implementation of it, never a base class: a test's clock (``tests.support.nowire.VirtualClock``)
implements the protocol itself, so that nothing of real time (its ``epoch`` on
``time.perf_counter``) is inherited by a clock that does not keep it. Checked on the source
(``ast``) of replay/, kvcal/, scenarios/ and tests/."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("replay", "kvcal", "scenarios", "tests")
CONCRETE = "MonotonicClock"


def sources(root: Path = ROOT) -> Iterator[Path]:
    for pkg in PACKAGES:
        yield from sorted((root / pkg).rglob("*.py"))


def _aliases(tree: ast.Module) -> set[str]:
    """The names ``MonotonicClock`` goes by in a module (``import ... as`` included)."""
    names = {CONCRETE}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname for a in node.names if a.name == CONCRETE and a.asname)
    return names


def _names_concrete(base: ast.expr, aliases: set[str]) -> bool:
    if isinstance(base, ast.Subscript):  # a generic base: MonotonicClock[...]
        base = base.value
    if isinstance(base, ast.Name):
        return base.id in aliases
    return isinstance(base, ast.Attribute) and base.attr == CONCRETE  # schedule.MonotonicClock


def subclasses(path: Path) -> list[str]:
    """``path:line Class`` for each class of ``path`` that subclasses ``MonotonicClock``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    aliases = _aliases(tree)
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return [
        f"{name}:{node.lineno} {node.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(_names_concrete(b, aliases) for b in node.bases)
    ]


def test_no_class_subclasses_monotonic_clock() -> None:
    found = [line for path in sources() for line in subclasses(path)]
    assert found == [], f"implement replay.core.schedule.Clock instead: {found}"


def test_the_rule_sees_every_spelling(tmp_path: Path) -> None:
    """A subclass by name, by module attribute or by an alias is found; a class that only
    implements the protocol, or uses a MonotonicClock, is not."""
    path = tmp_path / "planted.py"
    path.write_text(
        "from replay.core import schedule\n"
        "from replay.core.schedule import MonotonicClock\n"
        "from replay.core.schedule import MonotonicClock as Real\n"
        "class ByName(MonotonicClock): ...\n"
        "class ByModule(schedule.MonotonicClock): ...\n"
        "class ByAlias(Real): ...\n"
        "class Own:\n"
        "    real = MonotonicClock()\n"
        "    def now(self) -> float: ...\n"
        "    async def sleep_until(self, t: float) -> None: ...\n",
        encoding="utf-8",
    )
    found = [line.split()[-1] for line in subclasses(path)]
    assert found == ["ByName", "ByModule", "ByAlias"]
