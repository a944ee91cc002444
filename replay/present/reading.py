"""A run directory as the reports read it: leniently. Any file or key may be missing (older
or partial runs), and what cannot be read is a problem to list, not a failure: a broken
file reads as empty, a bad JSONL line is skipped and counted, and a summary value of the
wrong type is listed and reads as missing.

``Run`` also knows the run's order of targets, buckets and phases, each target's role, and
its colour in the charts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from replay.analysis.result_table import ResultTable
from replay.analysis.roles import Roles
from replay.analysis.schemas import Summary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.verdict.candidates import format_of
from replay.present.run_scan import Scan, json_lines, scan_run
from replay.rundir.files import MANIFEST, SUMMARY
from replay.serving.kv_formats import label

# A colour per target, the same in every chart; the A/A control is grey.
PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be185d")
CONTROL_COLOR = "#64748b"
CONTROL_SUFFIX = "-control"
T = TypeVar("T")


# -- tolerant access to JSON ----------------------------------------------------------------


def obj(x: object) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def lst(x: object) -> list[Any]:
    return x if isinstance(x, list) else []


def dig(x: object, *keys: str) -> Any:
    """``x[k1][k2]...`` or None where a key is missing or a level is not an object."""
    for k in keys:
        if not isinstance(x, dict):
            return None
        x = x.get(k)
    return x


def to_float(x: object) -> float | None:
    """A number that may be written as a string (cache_config_info's values are)."""
    try:
        return float(x) if isinstance(x, str | int | float) else None
    except ValueError:
        return None


# -- the run directory ------------------------------------------------------------------------


@dataclass
class Run:
    dir: Path
    manifest: Manifest
    summary: Summary  # read leniently: a value of the wrong type is a problem, and a dash
    scan: Scan  # what the report keeps of results.jsonl and grades.jsonl
    series: dict[str, list[dict[str, Any]]]
    problems: list[str] = field(default_factory=list)

    @property
    def reference(self) -> str | None:
        q = self.summary.quality
        return (q.reference if q else None) or self.manifest.reference or None

    def targets(self) -> list[str]:
        """Every target, in the run's order (the reference first)."""
        names: list[object] = [*self.manifest.targets, *self.summary.targets]
        names += self.scan.targets  # as the results name them, in order
        out = list(dict.fromkeys(n for n in names if isinstance(n, str)))
        return sorted(out, key=lambda n: (n != self.reference, n.endswith(CONTROL_SUFFIX)))

    def candidate(self) -> str | None:
        systems = self.summary.systems
        if systems is not None and systems.candidate is not None:
            return systems.candidate
        return self.roles().candidate

    def emulated(self, name: object) -> bool:
        """An emulated target: its quality is its format's, its capacity and speed BF16's."""
        return isinstance(name, str) and self.manifest.emulated(name)

    def kv_format(self, name: str) -> str | None:
        """The KV format a target is meant to run (an emulated one's too), if known."""
        return format_of(name, self.manifest)[0]

    def format_label(self, name: str) -> str:
        """FP8 for FP8 E4M3, else the format's name (for "emulated ..." labels)."""
        return label(self.kv_format(name) or "fp8")

    def roles(self) -> Roles:
        return Roles.from_manifest(
            self.manifest, [n for n in self.targets() if not n.endswith(CONTROL_SUFFIX)]
        )

    def phases(self) -> list[str]:
        q = self.summary.quality
        names = [*self.manifest.schedules, *(q.phases if q else ())]
        names += [p for t in self.summary.targets.values() for p in t.phases]
        names += self.scan.phases
        return list(dict.fromkeys(n for n in names if isinstance(n, str)))

    def in_order(self, items: Mapping[str, T], kind: str) -> list[tuple[str, T]]:
        """Items in the run's order of buckets, targets or phases (summary.json is written
        with sorted keys, which would put "256-1K" before "<256")."""
        order = {
            "bucket": list(self.manifest.buckets.labels),
            "target": self.targets(),
            "phase": self.phases(),
        }[kind]
        return sorted(
            items.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)
        )

    def color(self, target: str) -> str:
        if target.endswith(CONTROL_SUFFIX):
            return CONTROL_COLOR
        plain = [n for n in self.targets() if not n.endswith(CONTROL_SUFFIX)]
        return PALETTE[plain.index(target) % len(PALETTE)] if target in plain else PALETTE[-1]


def _read_object(path: Path, problems: list[str]) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return obj(orjson.loads(path.read_bytes()))
    except (OSError, orjson.JSONDecodeError) as exc:
        problems.append(f"{path.name}: unreadable ({exc})")
        return {}


def _read_lines(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    """JSON objects of a JSONL file; bad lines (a run cut short) are counted, not fatal."""
    return list(json_lines(path, problems))


def load_run(run_dir: Path, results: ResultTable | None = None) -> Run:
    """The run directory as the reports read it; ``results``: its results as the analysis
    just read them, so that the scan reads their columns, not results.jsonl again."""
    problems: list[str] = []
    series = {}
    metrics = run_dir / "metrics"
    if metrics.is_dir():
        series = {p.stem: _read_lines(p, problems) for p in sorted(metrics.glob("*.jsonl"))}
    manifest = Manifest.from_json(
        _read_object(run_dir / MANIFEST, problems), where=MANIFEST, problems=problems
    )
    summary = Summary.from_json(
        _read_object(run_dir / SUMMARY, problems), where=SUMMARY, problems=problems
    )
    run = Run(run_dir, manifest, summary, Scan(), series, problems)
    run.scan = scan_run(run_dir, run.reference, problems, results)
    return run
