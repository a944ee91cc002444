"""What the real models' figure scripts (``real_model.py``, ``long_model.py``) read off a run
directory and how they write it in Markdown: the command as a user types it, whether the
trace is the one committed, intervals and fractions, tables."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

BENCH = Path(__file__).resolve().parent
Doc = Mapping[str, Any]


def load(path: Path) -> Any:
    return orjson.loads(path.read_bytes())


def user_command(argv: list[str], prog: str = "replay") -> list[str]:
    """The command as a user types it: no output folder or run id of this machine."""
    out, skip = [prog], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg in ("--out", "--run-id"):
            skip = True
        else:
            out.append(arg)
    return out


def committed(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` noting whether its trace is the one committed at that path now."""
    path = BENCH.parent / run["trace"]
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {**run, "trace_committed": digest == run["trace_sha256"]}


def tf(row: Doc | None) -> dict[str, Any] | None:
    """A teacher-forced figure's mean, interval and count (None when nothing was scored)."""
    if not row or row.get("nll_delta_mean") is None:
        return None
    return {k: row.get(k) for k in ("nll_delta_mean", "nll_delta_lo", "nll_delta_hi", "requests")}


def nll(row: Doc | None) -> str:
    if not row:
        return "—"
    return f"{row['nll_delta_mean']:+.3f} [{row['nll_delta_lo']:+.3f}, {row['nll_delta_hi']:+.3f}]"


def frac(n: int | None, d: int | None) -> str:
    return "—" if not d else f"{n}/{d} ({100 * (n or 0) / d:.0f}%)"


def table(head: list[str], rows: list[list[str]]) -> Iterator[str]:
    yield "| " + " | ".join(head) + " |"
    yield "|" + "---|" * len(head)
    for r in rows:
        yield "| " + " | ".join(c.replace("|", "\\|") for c in r) + " |"
