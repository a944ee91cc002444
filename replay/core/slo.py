"""Service-level objectives: what a team promises per request, and the grammar of ``--slo``.

    --slo ttft=2s,itl=80ms,e2e=30s
    --slo "ttft=2s,e2e=30s;<8K:ttft=500ms;>=64K:ttft=8s,e2e=120s"

A request meets the SLOs when it succeeded and each given bound holds: ``ttft`` is its time to
the first token, ``itl`` its mean time per output token after the first (TPOT, as ``vllm bench
serve``'s goodput uses it; a one-token answer has none and meets it), ``e2e`` its time from send
to the last token. Scopes after a ``;`` name a bucket label and override the bounds they give for
that bucket. Goodput is the requests per second that met every SLO.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from replay.core.errors import InputError

METRICS = ("ttft", "itl", "e2e")
_UNITS = {"ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Slo:
    """Bounds in seconds; None: no bound on that metric."""

    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def bounds(self) -> dict[str, float]:
        return {m: v for m in METRICS if (v := getattr(self, m)) is not None}

    def to_json(self) -> dict[str, float]:
        return {f"{m}_ms": v * 1000 for m, v in self.bounds().items()}


@dataclass(frozen=True)
class SloSpec:
    """The run's SLOs: a default, and per-bucket overrides (by bucket label)."""

    default: Slo = field(default_factory=Slo)
    buckets: Mapping[str, Slo] = field(default_factory=dict)
    text: str = ""  # as given, for the manifest and the report

    def for_bucket(self, label: str) -> Slo:
        return self.buckets.get(label, self.default)

    def labels(self) -> list[str]:
        return list(self.buckets)


def _seconds(value: str, where: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*", value)
    if not m:
        raise InputError(f"{where}: '{value}' is not a duration; write e.g. 2s or 80ms")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise InputError(f"{where}: '{value}' must be above zero")
    return seconds


def _bounds(text: str, base: Slo, where: str) -> Slo:
    changes: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise InputError(f"{where}: '{part.strip()}' is not metric=duration (e.g. ttft=2s)")
        if key not in METRICS:
            raise InputError(f"{where}: unknown metric '{key}'; use {', '.join(METRICS)}")
        if key in changes:
            raise InputError(f"{where}: '{key}' is given twice")
        changes[key] = _seconds(value, f"{where} {key}")
    if not changes:
        raise InputError(f"{where}: no bound given; write e.g. ttft=2s,itl=80ms")
    return replace(base, **changes)


def parse_slo(text: str, bucket_labels: list[str] | None = None) -> SloSpec:
    """``--slo``'s value; InputError naming the part that is wrong. ``bucket_labels``, when
    given, are the run's buckets: a scope naming another label is an error."""
    scopes = [s for s in text.split(";") if s.strip()]
    if not scopes:
        raise InputError("--slo: empty; write e.g. ttft=2s,itl=80ms,e2e=30s")
    default = Slo()
    buckets: dict[str, Slo] = {}
    for i, scope in enumerate(scopes):
        label, sep, rest = scope.partition(":")  # durations hold no ':', bucket labels may '='
        if sep:
            label = label.strip()
            if bucket_labels is not None and label not in bucket_labels:
                raise InputError(
                    f"--slo: bucket '{label}' is not one of this run's buckets "
                    f"({', '.join(bucket_labels)})"
                )
            if label in buckets:
                raise InputError(f"--slo: bucket '{label}' is given twice")
            buckets[label] = _bounds(rest, default, f"--slo {label}")
        elif i == 0:
            default = _bounds(scope, Slo(), "--slo")
        else:
            raise InputError(
                f"--slo: '{scope.strip()}' needs a bucket label (e.g. '<8K:ttft=1s'); only "
                "the first scope is the default"
            )
    return SloSpec(default, buckets, text.strip())


def meets(slo: Slo, ok: bool, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
    """One request against its bucket's SLOs (seconds)."""
    if not ok:
        return False
    if slo.ttft is not None and (ttft is None or ttft > slo.ttft):
        return False
    if slo.itl is not None and tpot is not None and tpot > slo.itl:
        return False
    return not (slo.e2e is not None and (e2e is None or e2e > slo.e2e))
