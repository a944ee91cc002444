"""The Markdown report, for a PR comment: the verdict and its evidence, then the serving-path,
quality and latency tables and, for a load sweep, its knees and levels, from the same views
as the HTML report. Every cell is one line with pipes and angle brackets escaped, so a
table keeps its shape whatever the text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay.present.formatting import DASH, visible
from replay.present.reading import Run
from replay.present.sections import build_views
from replay.present.views import Table
from replay.present.views.quality import QUALITY_HEADERS

# The columns of QUALITY_HEADERS a PR comment keeps (explicit and derived side by side).
MD_QUALITY = tuple(QUALITY_HEADERS[i] for i in (0, 1, 2, 3, 4, 5, 6, 7, 11))


def markdown_report(run: Run) -> str:
    """The Markdown summary of a run."""
    views, problems = build_views(
        run,
        ("verdict", "serving", "quality", "systems", "latency", "load", "sequential", "workers"),
    )
    out = _md_verdict(run, views["verdict"] or {})
    out += _md_section("Serving path", (views["serving"] or {}).get("table"))
    tables = (views["quality"] or {}).get("tables") or [{"table": None}]
    for qt in tables:
        caption = f" ({qt['table'].caption})" if qt["table"] else ""
        out += _md_section(f"Quality{caption}", qt["table"], MD_QUALITY)
        if qt.get("trends"):
            out += ["Trend across context length, per doubling of the prompt's tokens:", ""]
            out += [f"- {md(line)}" for line in qt["trends"]] + [""]
        if qt.get("rules"):
            out += _md_section(f"Derived rules{caption}", qt["rules"])
    systems = views["systems"] or {}
    if systems.get("rule") is not None:  # what the verdict weighed
        out += _md_section("Systems", systems["rule"])
        out += [systems["rule_note"], ""]
        if systems.get("capacity") is not None:
            out += _md_section("Capacity phase", systems["capacity"])
    else:
        out += _md_section(
            "Latency",
            systems.get("latency")
            or next(
                (p["table"] for p in (views["latency"] or {}).get("phases", []) if p["table"]),
                None,
            ),
        )
    if views["sequential"]:  # only a sequential canary has this section
        out += _md_section("Sequential canary", views["sequential"]["table"])
        out += [views["sequential"]["note"], ""]
    if views["load"]:  # only a load sweep has this section
        out += _md_section("Load: knee and SLO ceiling per bucket", views["load"]["knees"])
        out += _md_section("Load: each level", views["load"]["totals"])
    if views["workers"]:  # only a distributed Locust run has this section
        out += _md_section("Workers", views["workers"]["table"])
    if problems:
        out += ["### Problems reading this run", ""] + [f"- {md(p)}" for p in problems]
    return "\n".join(out).rstrip() + "\n"


def _md_verdict(run: Run, v: Mapping[str, Any]) -> list[str]:
    out = [f"## kvcanary `{md(run.dir.name)}`: {md(v.get('word', 'NO VERDICT'))}", ""]
    if not v.get("present"):
        return [*out, "Verdict: not measured in this run.", ""]
    out += [f"**{md(v['headline'])}** (exit code {md(v['exit_code'])})", ""]
    out += [f"- {md(r)}" for r in v["reasons"]] + ([""] if v["reasons"] else [])
    if v["evidence"].rows:
        out += ["### Evidence", ""]
        for kind, bucket, finding, *_ in v["evidence"].rows:
            where = f" ({md(bucket.text)})" if bucket.text != DASH else ""
            out.append(f"- **{md(kind.text)}**{where}: {md(finding.text)}")
        out.append("")
    if v.get("candidates") is not None:
        out += _md_section("Every candidate", v["candidates"])
    return out


def md(s: object) -> str:
    """Text for a Markdown table cell or bullet: one line, nothing that acts (``visible``),
    pipes and angle brackets escaped."""
    t = visible(" ".join(str(s).split()))
    return t.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _md_section(title: str, t: Table | None, cols: Sequence[str] | None = None) -> list[str]:
    if t is None:
        return [f"### {title}", "", "Not measured in this run.", ""]
    idx = [i for i, h in enumerate(t.headers) if cols is None or h in cols]
    caption = [f"_{md(t.caption)}_", ""] if t.caption and t.caption not in title else []
    out = [f"### {title}", "", *caption]
    out.append("| " + " | ".join(md(t.headers[i]) for i in idx) + " |")
    out.append("|" + "|".join(" --- " for _ in idx) + "|")
    out += ["| " + " | ".join(md(row[i].text) for i in idx) + " |" for row in t.rows]
    return [*out, ""]
