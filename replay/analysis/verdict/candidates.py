"""Several candidates in one run (``--targets bf16,fp8,fp8_e5m2``): each decided on its own
against the reference by the stop rule, at a level that accounts for how many there are, and
in the words of its own KV format.

* **Multiplicity.** With ``k`` candidates each is decided at ``alpha / k`` (Bonferroni: the
  chance that any of them is wrongly called a loss, or wrongly shown within the tolerance,
  stays at most ``alpha`` whatever their dependence; they answer the same requests). Each
  verdict says so in its evidence. One candidate is the single-candidate rule.
* **One rule per candidate.** Each gets the run's facts with itself as the candidate, its
  own systems comparison with the reference, and no calibrated or layers arm (nor kvcal
  advise's figures) unless it is the primary one: those arms are the primary candidate's
  format with kvcal's scales or some layers in BF16.
* **The format's words.** The stop rule speaks of FP8; a candidate of another format gets
  its verdict titled with its own name. A format that computes its scales when the cache is
  written (the per-token-head ones) cannot be calibrated: where the rule says CALIBRATE, its
  verdict is REJECT, with the rule's reason after why. An emulated format is named as such.

The primary candidate (``--candidate``, else the first) decides the run's verdict and exit
code; every candidate's verdict is in the summary's ``candidates``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from replay.analysis.schemas import Summary, Systems, Verdict
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import Facts, facts_from_run
from replay.analysis.verdict.rule import decide, quality_decides
from replay.analysis.verdict.wording import VERDICTS, evidence_entry
from replay.serving import kv_formats

E4M3 = frozenset({"fp8", "fp8_e4m3"})


def decide_candidates(
    summary: Summary,
    manifest: Manifest,
    candidates: Sequence[str],
    primary: str | None,
    systems_of: Mapping[str, Systems | None],
    thresholds: Thresholds,
) -> dict[str, Verdict]:
    """Every candidate's verdict, by name, in ``candidates``' order."""
    k = len(candidates)
    th = _level(thresholds, k)
    out = {}
    for name in candidates:
        facts = _facts(replace(summary, systems=systems_of.get(name)), manifest, name, primary, th)
        verdict = in_its_words(decide(facts, th), name, manifest)
        extra = []
        if k > 1:
            extra.append(
                evidence_entry(
                    "multiplicity",
                    f"{k} candidates in this run ({', '.join(candidates)}): each decided at "
                    f"alpha {th.alpha:.3g} ({thresholds.alpha:g} / {k}, Bonferroni)",
                )
            )
        capacity = _implied_capacity(name, manifest)
        if capacity:
            extra.append(evidence_entry("systems", capacity))
        out[name] = replace(verdict, evidence=(*verdict.evidence, *extra))
    return out


def quality_first(
    summary: Summary,
    manifest: Manifest,
    candidates: Sequence[str],
    primary: str,
    thresholds: Thresholds,
) -> Verdict | None:
    """The primary candidate's verdict where its quality side decides it alone
    (``rule.quality_decides``), as ``decide_candidates`` would give it (at the run's
    multiplicity, in its format's words); None where whether it pays decides."""
    th = _level(thresholds, len(candidates))
    verdict = quality_decides(_facts(summary, manifest, primary, primary, th), th)
    return None if verdict is None else in_its_words(verdict, primary, manifest)


def _level(thresholds: Thresholds, k: int) -> Thresholds:
    """Each of ``k`` candidates' thresholds: alpha / k."""
    return replace(thresholds, alpha=thresholds.alpha / k) if k > 1 else thresholds


def _facts(
    summary: Summary, manifest: Manifest, name: str, primary: str | None, th: Thresholds
) -> Facts:
    """A candidate's facts: its own, and the calibrated and layers arms only for the primary."""
    facts = facts_from_run(summary, manifest, candidate=name, thresholds=th)
    if name != primary:
        facts = replace(facts, calibrated=None, layers=None, layers_skipped=(), advice=None)
    return facts


def format_of(name: str, manifest: Manifest) -> tuple[str | None, bool]:
    """(the KV format a target is meant to run, whether it is emulated), from its spec, else
    from its name."""
    spec = manifest.spec(name)
    meant = spec.meant_format if spec is not None else None
    text = meant or kv_formats.format_of_name(name)
    if text is None:
        return None, False
    emulated = kv_formats.emulated_format(text)
    return (emulated or text), emulated is not None


def in_its_words(v: Verdict, name: str, manifest: Manifest) -> Verdict:
    """The stop rule's verdict for a candidate of another format than FP8 E4M3: titled with
    its name, and REJECT where the rule asks to calibrate a format that has no scales to
    calibrate."""
    fmt_name, emulated = format_of(name, manifest)
    fmt = kv_formats.get(fmt_name) if fmt_name else None
    if fmt is None or not fmt.quantized or fmt.name in E4M3:
        return v
    kind, reasons = v.verdict, list(v.reasons)
    if kind == "calibrate" and not fmt.reads_checkpoint_scales:
        kind = "reject"
        reasons[0] = (
            f"{fmt.name} computes its K/V scales per token and head when the cache is "
            f"written, so no calibration applies: {reasons[0]}"
        )
    if kind == "emulated":
        reasons[0] = (
            f"{name} emulates {fmt.name} (a BF16 server rounding K/V through it): its quality "
            "evidence is below, but a rollout decision needs a server that serves "
            f"{fmt.name} (or --accept-emulated to decide on quality alone)"
        )
    title = _title(kind, fmt, emulated)
    return replace(
        v,
        verdict=kind,
        exit_code=VERDICTS[kind][0],
        headline=f"{title}: {reasons[0]}" if reasons else title,
        reasons=tuple(reasons),
    )


def _title(kind: str, fmt: kv_formats.KVFormat, emulated: bool) -> str:
    label = fmt.name + (" at scale 1.0" if fmt.reads_checkpoint_scales else "")
    titles = {
        "keep": f"KEEP {label}",
        "calibrate": f"CALIBRATE {fmt.name}'s K/V scales",
        "reject": f"REJECT {fmt.name} for this path",
        "emulated": f"NO VERDICT ON EMULATED {fmt.name}",
    }
    return titles.get(kind, VERDICTS[kind][1])


def _implied_capacity(name: str, manifest: Manifest) -> str | None:
    """An emulated candidate's capacity as its format's bytes imply it (never measured: its
    server stores BF16), at the model's head size where the local model says it."""
    fmt_name, emulated = format_of(name, manifest)
    fmt = kv_formats.get(fmt_name) if fmt_name else None
    if not emulated or fmt is None:
        return None
    spec = manifest.spec(name)
    head = kv_formats.head_size_of(spec.model if spec is not None else None)
    if head is None:
        return None
    return (
        f"{name}: {fmt.name} holds {fmt.capacity_ratio(head):.2f}x BF16's tokens in the same "
        f"cache by its bytes (head size {head}); implied, not served"
    )
