"""The report's first sections: the verdict with its evidence and a few numbers at a glance,
and the serving path (does each target run the path it is meant to test)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from replay.analysis.schemas import TargetSummary
from replay.analysis.schemas.manifest import Manifest, TargetEntry
from replay.analysis.verdict.serving_path import serving_problems
from replay.analysis.verdict.wording import VERDICTS
from replay.present.formatting import f_est, f_int, f_p, f_pts, f_ratio, num, text
from replay.present.reading import CONTROL_SUFFIX, Run, to_float
from replay.present.views import Cell, Table

# Each verdict as the few words the top of the report shows in large type.
SHORT = {
    "keep": "KEEP",
    "calibrate": "CALIBRATE",
    "per_head_or_skip_layers": "PER-HEAD / SKIP LAYERS",
    "reject": "REJECT",
    "insufficient_evidence": "INSUFFICIENT EVIDENCE",
    "emulated": "EMULATED: NO VERDICT",
}


def verdict_view(run: Run) -> dict[str, Any]:
    v = run.summary.verdict
    kind = (v.verdict if v else None) or None
    title = VERDICTS.get(kind or "", (None, ""))[1]
    ev = Table(
        [
            "Kind",
            "Bucket",
            "Finding",
            "Pairs",
            "Δ pass rate, pts [95% CI]",
            "McNemar p",
            "Noise floor (low end, pts)",
        ]
    )
    # An evidence entry is the verdict's own JSON object (its keys depend on its kind).
    for e in v.evidence if v else ():
        ev.add(
            text(e.get("kind")),
            text(e.get("bucket")),
            Cell(text(e.get("text"))),
            f_int(e.get("pairs")),
            f_est(e.get("diff"), e.get("lo"), e.get("hi"), f_pts),
            f_p(e.get("mcnemar_p")),
            f_pts(e.get("floor_lo")),
        )
    headline = v.headline if v else None
    return {
        "present": v is not None,
        "kind": kind or "none",
        "word": SHORT.get(kind or "", (kind or "no verdict").upper()),
        "title": title,
        "headline": text(headline),
        "exit_code": text(v.exit_code if v else None),
        "reasons": [r for r in (v.reasons if v else ()) if not str(headline).endswith(r)],
        "evidence": ev,
        "glance": glance(run),
        "candidates": candidates_table(run),
    }


def candidates_table(run: Run) -> Table | None:
    """With several candidates, each one's own verdict (the first row decides the run)."""
    verdicts = run.summary.candidates
    if not verdicts:
        return None
    t = Table(["Candidate", "KV format", "Verdict", "Exit code", "Why"])
    for name, v in verdicts.items():
        fmt = run.kv_format(name)
        t.add(
            name,
            text(fmt) + (" (emulated)" if run.emulated(name) else ""),
            Cell(SHORT.get(v.verdict, v.verdict.upper()), "good" if v.verdict == "keep" else "bad"),
            text(v.exit_code),
            Cell(text(v.headline)),
        )
    t.caption = (
        "each candidate decided on its own against the reference, at alpha divided by the "
        "number of candidates; the primary candidate's verdict is the run's"
    )
    return t


def glance(run: Run) -> list[tuple[str, str]]:
    """A few numbers beside the verdict: who was compared, on how much, what FP8 gains."""
    ref, cand = run.reference, run.candidate()
    t_ref, t_cand = (run.summary.targets.get(n or "") for n in (ref, cand))
    a, b = (t.kv_cache_size_tokens if t else None for t in (t_ref, t_cand))
    cap = b / a if a and b and not run.emulated(cand) else None
    q, systems = run.summary.quality, run.summary.systems
    first = next(iter(run.in_order(q.phases, "phase")), None) if q else None
    arm = first[1].get(cand or "") if first else None
    vs = arm.all.vs_reference if arm else None
    return [
        ("reference", text(ref)),
        ("candidate", text(cand)),
        (
            "status (reference / candidate)",
            f"{text(t_ref.status if t_ref else None)} / {text(t_cand.status if t_cand else None)}",
        ),
        ("graded pairs", f_int(vs.pairs if vs else None)),
        ("KV-cache capacity", f_ratio(cap)),
        ("throughput", f_ratio(systems.throughput_ratio if systems else None)),
    ]


def serving_view(run: Run) -> dict[str, Any]:
    t = Table(
        [
            "Target",
            "Role",
            "Status",
            "Expected cache dtype",
            "Served cache dtype",
            "KV cache (tokens)",
            "Engine",
            "Model",
            "Max model len",
            "Server",
            "Findings",
        ]
    )
    details = []
    for name in run.targets():
        m = run.manifest.target(name) or TargetEntry.from_json({})
        s = run.summary.targets.get(name) or TargetSummary.from_json({})
        served = s.cache_dtype or m.cache_config.get("cache_dtype")
        findings = _findings(run, name, m, s, served)
        server = m.server
        t.add(
            Cell(name, title=text(m.spec.model)),
            _role(run, name),
            Cell(
                text(s.status or m.status),
                "good" if (s.status or m.status) == "ok" else "bad",
            ),
            text(m.spec.meant_format),
            text(served) + (f" (emulated {run.format_label(name)})" if run.emulated(name) else ""),
            f_int(
                s.kv_cache_size_tokens or num(to_float(m.cache_config.get("kv_cache_size_tokens")))
            ),
            text(m.engine_version),
            text(m.model_id),
            f_int(m.max_model_len),
            text(server.get("url")) + (f" (pid {server['pid']})" if server.get("pid") else ""),
            Cell("; ".join(findings) or "none", "bad" if findings else "good"),
        )
        details.append(
            {
                "name": name,
                "reason": m.reason or s.reason,
                "scale_lines": list(m.scale_log_lines),
                "engine": sorted((str(k), str(v)) for k, v in (m.engine_config or {}).items()),
                "cache": sorted((str(k), str(v)) for k, v in m.cache_config.items()),
                "problems": list(m.problems),
            }
        )
    return {"table": t if t.rows else None, "details": details}


def _role(run: Run, name: str) -> str:
    if name == run.reference:
        return "reference"
    if name.endswith(CONTROL_SUFFIX):
        return "A/A control"
    return "calibrated" if name == run.roles().calibrated else "candidate"


def _findings(run: Run, name: str, m: TargetEntry, s: TargetSummary, served: object) -> list[str]:
    """What says this target does not run the path it is meant to test (as the verdict sees
    it); the reference and the control only report failing."""
    status = s.status or m.status or None
    reason = s.reason or m.reason
    if status not in ("ok", "failed", None):
        return [f"status '{status}': {text(reason) if reason else 'no outcome recorded'}"]
    if name == run.reference or name.endswith(CONTROL_SUFFIX):
        return [] if status in ("ok", None) else [f"target failed: {text(reason)}"]
    merged = TargetSummary(
        status=None if status is None else str(status),
        reason=None if reason is None else str(reason),
        cache_dtype=None if served is None else str(served),
        kv_cache_size_tokens=None,
        phases={},
    )
    # The verdict's own check, on the spec and what the server's log said of this target.
    entry = replace(
        TargetEntry.from_json({}),
        spec=m.spec,
        scale_log_lines=m.scale_log_lines,
        engine_config=m.engine_config,
    )
    alone = replace(Manifest.from_json({}), targets={name: entry})
    return serving_problems(name, merged, alone, name == run.roles().calibrated)
