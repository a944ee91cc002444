"""What a GPU machine needs beside the working tree to run ``bench/kvcal_gpu.py``: the wheels
of the packages kvcal imports there that torch and transformers do not bring, and the one
command that installs them offline and runs the bench.

The GPU machine is trusted to hold torch, transformers and what each requires directly, and
nothing of ours: no network, no vLLM (its image holds more, but which versions it holds of the
rest is not ours to know, and what is carried is small). Which packages kvcal imports is
measured, not listed: the dry run records the top-level modules each kvcal step imported
(``_kvcal_gpu_steps``); those among kvcanary's own requirements and what they require, and
not trusted to be there, are carried, with what they require in turn. Each wheel is this
environment's version of the package, built for the machine's Python (3.12) on x86-64 Linux.
The working tree (tracked and untracked files git does not ignore) and the carried folder
travel together, at most 64 MiB.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CARRY = Path("bench/.kvcal_gpu")  # git-ignored; named in the device call's carry
LIMIT_BYTES = 64 * 2**20
PROJECT = "kvcanary"
ON_THE_MACHINE = ("torch", "transformers")
PYTHON = "3.12"
# pip matches a manylinux tag exactly: the ones wheels are commonly built for, all older
# than the machine's glibc
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35, 39)),
)
SITE = "/tmp/kvcal-site"


def norm(name: str) -> str:
    """A distribution's name as the index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requires(dist: str, extras: Iterable[str] = (), python: str | None = None) -> set[str]:
    """The distributions ``dist`` requires (with ``extras``) where it is installed, for this
    Python or ``python``."""
    env = {k: str(v) for k, v in default_environment().items()}
    if python is not None:
        env["python_version"] = python
        env["python_full_version"] = python + ".0"
    out = set()
    for text in md.distribution(dist).requires or []:
        req = Requirement(text)
        wanted = req.marker is None or any(
            req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)
        )
        if wanted:
            out.add(norm(req.name))
    return out


def closure(roots: Iterable[str], python: str | None = None) -> set[str]:
    """``roots`` and everything they require, transitively, among what is installed here."""
    seen: set[str] = set()
    todo = [norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += sorted(requires(name, python=python))
        except md.PackageNotFoundError:
            continue  # required only on another platform, or optional
    return seen


def imported_distributions(modules: Iterable[str]) -> set[str]:
    """The installed distributions that provide these top-level modules."""
    owners = md.packages_distributions()
    return {norm(d) for m in modules for d in owners.get(m, ())}


def to_carry(modules: Iterable[str], python: str = PYTHON) -> dict[str, str]:
    """{distribution: version here} to carry for a run that imported ``modules``."""
    there = {norm(d) for d in ON_THE_MACHINE}
    there |= {r for d in ON_THE_MACHINE for r in requires(d, python=python)}
    ours = closure(requires(PROJECT, python=python), python)  # its core, not its extras
    needed = (imported_distributions(modules) & ours) - there
    # what they require travels too, trusted or not: they may need a newer version of it
    carried = closure(needed, python) - {norm(d) for d in ON_THE_MACHINE}
    return {name: md.version(name) for name in sorted(carried)}


def download(dists: dict[str, str], dest: Path, python: str = PYTHON) -> list[Path]:
    """Each distribution's wheel for the GPU machine's Python on x86-64 Linux, into ``dest``
    (emptied of wheels first, so that only one version of each travels)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest)]
    cmd += ["--only-binary=:all:", "--implementation", "cp", "--python-version", python]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += [f"{name}=={version}" for name, version in dists.items()]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels: tracked files and untracked ones git does not
    ignore (a deleted tracked file does not)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    names = {n for n in listed.decode().split("\0") if n}
    return sum((root / n).stat().st_size for n in names if (root / n).is_file())


def device_command(carry: Path = CARRY) -> str:
    """The one command the GPU machine runs: install the wheels offline, then the bench,
    its results written under ``$OUT``."""
    return (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
        f"--target {SITE} {carry}/*.whl || exit 1; PYTHONPATH={SITE} PYTHONUNBUFFERED=1 "
        f'python3 bench/kvcal_gpu.py run --device cuda --out "$OUT"'
    )
