"""The per-request drill-down: every request's attempts across targets and phases, with
its prompt excerpt, answers, tool calls, checker outcomes and agreement, regressions first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay.present.formatting import DASH, f_int, f_sig, num, text
from replay.present.prompts import load_prompts
from replay.present.reading import CONTROL_SUFFIX, Run, lst, obj
from replay.present.run_scan import rows_of
from replay.rundir.files import GRADES, RESULTS

MAX_REQUESTS = 500
ANSWER_CHARS = 500


def requests_view(run: Run) -> dict[str, Any]:
    """The ``MAX_REQUESTS`` requests to show, regressions first, then errors, then answers
    that differ, each group in the results' order: chosen from the scan's facts, then read
    whole (their results and grades) from the run directory."""

    def key(row: Mapping[str, Any]) -> tuple[str, str, str]:
        return str(row.get("target")), str(row.get("phase")), str(row.get("request_id"))

    facts = run.scan.requests
    chosen = sorted(facts, key=lambda rid: (_severity(facts[rid].flags()), facts[rid].order))
    shown_ids = chosen[:MAX_REQUESTS]
    wanted = set(shown_ids)
    grades = {key(g): g for g in rows_of(run.dir / GRADES, wanted)}
    by_id: dict[str, list[dict[str, Any]]] = {rid: [] for rid in shown_ids}
    for r in rows_of(run.dir / RESULTS, wanted):
        by_id[str(r.get("request_id"))].append(r)
    rank = {t: i for i, t in enumerate(run.targets())}
    phases = {p: i for i, p in enumerate(run.phases())}
    shown = []
    for rid, rs in by_id.items():
        rs.sort(
            key=lambda r: (phases.get(str(r.get("phase")), 99), rank.get(str(r.get("target")), 99))
        )
        attempts = [_attempt(r, grades.get(key(r))) for r in rs]
        shown.append((rid, rs, attempts, _flags(run, attempts)))
    prompts, note = load_prompts(run, shown_ids) if shown else ({}, "")
    return {
        "total": len(facts),
        "shown": len(shown),
        "trace_note": note,
        "items": [
            {
                "id": rid,
                "bucket": text(rs[0].get("bucket")),
                "flags": flags,
                "task": text(next((a["task"] for a in att if a["task"] != DASH), None)),
                "prompt": prompts.get(rid),
                "attempts": att,
                "badges": _badges(run, att),
            }
            for rid, rs, att, flags in shown
        ],
    }


def _attempt(r: Mapping[str, Any], g: Mapping[str, Any] | None) -> dict[str, Any]:
    g = obj(g)
    grade, ag = obj(g.get("grade")), obj(g.get("agreement"))
    out = str(r.get("output_text") or "")
    calls = [
        f"{obj(c).get('name', '?')}({obj(c).get('arguments', '')})"
        for c in lst(r.get("tool_calls"))
    ]
    err = r.get("error") or g.get("error")
    passed = grade.get("passed") if isinstance(grade.get("passed"), bool) else None
    return {
        "target": text(r.get("target")),
        "phase": text(r.get("phase")),
        "status": text(r.get("status")),
        "ok": r.get("status", "ok") == "ok",
        "error": None
        if r.get("status", "ok") == "ok" and not err
        else f"{text(r.get('error_kind'))}: {text(err)}",
        "ttft": f_sig(None if num(r.get("ttft")) is None else 1000 * float(r["ttft"])),
        "tokens": f_int(r.get("output_tokens")),
        "finish": text(r.get("finish_reason")),
        "answer": out[:ANSWER_CHARS],
        "more": max(0, len(out) - ANSWER_CHARS),
        "calls": calls,
        "passed": passed,
        "reason": grade.get("reason"),
        "task": text(g.get("task")),
        "agreement": DASH
        if not ag
        else (
            "identical"
            if ag.get("exact")
            else "same after normalizing"
            if ag.get("normalized")
            else f"differs from token {f_int(ag.get('first_divergence'))}"
        ),
    }


def _flags(run: Run, attempts: Sequence[Mapping[str, Any]]) -> list[str]:
    """regressed: a candidate fails where the reference passes (same phase)."""
    ref_pass = {a["phase"] for a in attempts if a["target"] == run.reference and a["passed"]}
    flags = []
    if any(
        a["passed"] is False
        and a["phase"] in ref_pass
        and a["target"] != run.reference
        and not a["target"].endswith(CONTROL_SUFFIX)
        for a in attempts
    ):
        flags.append("regressed")
    if any(not a["ok"] for a in attempts):
        flags.append("error")
    if any(a["agreement"].startswith("differs") for a in attempts):
        flags.append("differs")
    return flags


def _severity(flags: Sequence[str]) -> int:
    return next((i for i, f in enumerate(("regressed", "error", "differs")) if f in flags), 3)


def _badges(run: Run, attempts: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """Per target: (name, passed/graded or status, css class)."""
    out = []
    for t in run.targets():
        mine = [a for a in attempts if a["target"] == t]
        if not mine:
            continue
        graded = [a["passed"] for a in mine if a["passed"] is not None]
        bad = sum(not a["ok"] for a in mine)
        label = f"{sum(graded)}/{len(graded)} pass" if graded else "ungraded"
        label += f", {bad} error{'s' if bad > 1 else ''}" if bad else ""
        cls = "bad" if bad or (graded and not all(graded)) else "good" if graded else "dim"
        out.append((t, label, cls))
    return out
