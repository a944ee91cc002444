"""The verdict in words: its kinds' titles and exit codes, and the evidence entries and
sentences the stop rule (``rule``) attaches to what it decides.

Each evidence entry is a JSON object (``Verdict.evidence``): its kind ("serving", "quality",
"systems", "warning"), its text and, for a bucket, the bucket's facts and its evidence under
the thresholds decided with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from replay.analysis.schemas import Verdict
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import ArmFacts, BucketFacts
from replay.core.exit_codes import ExitCode

VERDICTS: dict[str, tuple[int, str]] = {
    "keep": (ExitCode.OK, "KEEP FP8 at scale 1.0"),
    "calibrate": (ExitCode.VERDICT_CALIBRATE, "CALIBRATE the FP8 K/V scales"),
    "per_head_or_skip_layers": (
        ExitCode.VERDICT_PER_HEAD_OR_SKIP_LAYERS,
        "TRY PER-HEAD SCALES OR BF16 FOR SOME LAYERS",
    ),
    "reject": (ExitCode.VERDICT_REJECT, "REJECT FP8 for this path"),
    "insufficient_evidence": (ExitCode.VERDICT_INSUFFICIENT_EVIDENCE, "INSUFFICIENT EVIDENCE"),
    "emulated": (ExitCode.VERDICT_EMULATED_FP8, "NO VERDICT ON EMULATED FP8"),
}


def verdict_record(
    kind: str, reasons: Sequence[str], evidence: Sequence[dict[str, Any]]
) -> Verdict:
    """The verdict of ``kind``: its headline is the title and the first reason."""
    code, title = VERDICTS[kind]
    return Verdict(
        verdict=kind,
        exit_code=code,
        headline=f"{title}: {reasons[0]}" if reasons else title,
        reasons=tuple(reasons),
        evidence=tuple(evidence),
    )


def points(x: float | None) -> str:
    """A rate difference in signed percentage points."""
    return "n/a" if x is None else f"{100 * x:+.1f}"


def where(b: BucketFacts) -> str:
    """The bucket, with its phase where the run has several."""
    return b.bucket if b.phase is None else f"{b.bucket} ({b.phase})"


def bucket_text(arm: str, ref: str, b: BucketFacts, th: Thresholds) -> str:
    """One bucket's comparison in a sentence: difference, interval, pairs, McNemar, noise
    floor and the exact bound of the drop."""
    if b.mcnemar_p is None:
        return f"{arm} in {where(b)}: no graded pairs"
    floor = "" if b.floor_lo is None else f", noise floor from {points(b.floor_lo)}"
    ev = b.evidence(th)
    bound = (
        ""
        if ev is None
        else (
            f", drop at most {100 * ev.drop_bound:.1f} points (exact "
            f"one-sided {100 * (1 - th.alpha):g}%)"
        )
    )
    kinds = f" ({b.pairs - b.derived} explicit, {b.derived} derived)" if b.derived else ""
    return (
        f"{arm} vs {ref} in {where(b)}: {points(b.diff)} points [{points(b.lo)}, {points(b.hi)}]"
        f" over {b.pairs} pairs{kinds}, McNemar p={b.mcnemar_p:.3g}{floor}{bound}"
    )


def evidence_entry(
    kind: str,
    text: str,
    b: BucketFacts | None = None,
    th: Thresholds | None = None,
    phases: int = 1,
) -> dict[str, Any]:
    """An evidence entry; with a bucket, its facts and its evidence under ``th``."""
    if b is None:
        return {"kind": kind, "text": text}
    ev = None if th is None else b.evidence(th, phases)
    # The evidence under the thresholds decided with, not whatever the facts were built with.
    extra = (
        {}
        if ev is None
        else {"needed": ev.needed, "status": ev.status, "drop_bound": ev.drop_bound}
    )
    return {"kind": kind, "text": text, **asdict(b), **extra}


def quality_evidence(arm: ArmFacts, ref: str, th: Thresholds) -> list[dict[str, Any]]:
    """One "quality" entry per bucket and phase of ``arm``."""
    return [
        evidence_entry("quality", bucket_text(arm.name, ref, b, th), b, th, arm.phases)
        for b in arm.buckets
    ]
