"""The import contracts in pyproject.toml ([tool.importlinter]) hold, and they bite: a wrong-way
import planted in a copy of the tree breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter comes with the dev extra")

ROOT = Path(__file__).resolve().parents[1]


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
        ("replay/core/trace.py", "import torch", "the core never imports"),
        ("replay/checkers/_text.py", "import locust", "the core never imports"),
        ("replay/run/runner.py", "import kvcal", "kvcal may import replay"),
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
