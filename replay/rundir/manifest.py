"""The run manifest, written by both drivers (the CLI's runner and the Locust adapter) through
one builder and read back through one reader: a run directory says what ran, on what machine,
with which trace, buckets, schedules and options, and what happened to each target, in the same
shape whichever made it. Each fact is written once: the run spec holds the trace's path, digest
and length policy, the buckets and the schedules, the roles the reference, and the ``trace``
block only what reading the file found. ``replay report``, the analysis, ``--resume`` and kvcal
read it as a ``Manifest`` (its records are in ``replay/analysis/schemas/manifest.py``), which
reads those facts back where older manifests had them too."""

from __future__ import annotations

import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from replay.analysis.roles import Roles
from replay.analysis.run_spec import RunSpec
from replay.analysis.schemas.manifest import MANIFEST_FILE, Manifest
from replay.core.credentials import redact
from replay.core.version import __version__
from replay.serving.targets import TargetSpec

# The CPU features that decide which vLLM CPU kernels (FP8 KV among them) exist.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, bool]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: f in flags for f in CPU_FLAGS}


def platform_facts() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_flags": cpu_flags(),
    }


def trace_facts(
    lines: int, bad_lines: int, skipped: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """What reading the trace found, which the run spec (its path, digest, requests and
    length policy) does not hold: the lines read, those skipped as unreadable, and
    ``skipped``: rows the trace itself marks as not to replay (failed requests), by kind."""
    return {"lines": lines, "bad_lines": bad_lines, "skipped_rows": dict(skipped or {})}


def target_entry(
    spec: TargetSpec,
    status: str,
    reason: str | None,
    info: Mapping[str, Any],
    phases: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """One target: its spec, how it ended, what introspection found, and its phase windows."""
    return {"spec": spec.describe(), "status": status, "reason": reason, **info, "phases": phases}


def build_manifest(
    *,
    command: Sequence[str],
    started_at: float,
    trace: Mapping[str, Any],
    spec: RunSpec,
    roles: Roles,
    options: Mapping[str, Any],
    targets: Mapping[str, Mapping[str, Any]],
    driver: Mapping[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The manifest of a run. ``trace``: what reading it found (``trace_facts``); ``spec``:
    the run as both drivers describe it (its ``run_spec`` block, which ``read_manifest`` reads
    back as ``Manifest.run_spec``), which alone holds the trace's path and digest, the buckets
    and the schedules; ``roles``: which target plays which part, the reference among them.
    ``driver`` names a driver other than the CLI (Locust) and what drove it; ``extra`` holds a
    driver's own facts (the CLI's flags and resume notes, results a looping Locust test counted
    but did not store), placed before the targets."""
    return {
        "tool": {"name": "kvcanary", "version": __version__},
        **({"driver": dict(driver)} if driver is not None else {}),
        # argv as typed, but a --targets URL's user-info and query values are credentials
        "command": [redact(arg) for arg in command],
        "started_at": started_at,
        "platform": platform_facts(),
        "trace": dict(trace),
        "options": dict(options),
        "run_spec": spec.to_json(),
        "roles": roles.to_json(),
        **extra,
        "targets": dict(targets),
    }


def read_manifest(run_dir: Path, problems: list[str] | None = None) -> Manifest:
    """The manifest of the run in ``run_dir``. Without ``problems``, an unreadable file or a
    value of the wrong type raises (``OSError``, ``ValueError``; ``SummaryError`` naming the
    field); with it, each wrong value is listed there and reads as missing."""
    path = run_dir / MANIFEST_FILE
    data = orjson.loads(path.read_bytes())
    return Manifest.from_json(data, where=str(path), problems=problems)


def written_targets(run_dir: Path) -> dict[str, Any]:
    """The target entries of the run's manifest as they were written (``--resume`` carries
    them forward whole, keys no record types included); empty when there are none."""
    try:
        targets = orjson.loads((run_dir / MANIFEST_FILE).read_bytes()).get("targets")
    except (OSError, ValueError, AttributeError):
        return {}
    return dict(targets) if isinstance(targets, dict) else {}
