"""The self-contained HTML report: the section views and a header rendered through the Jinja
template beside this module (``report_template.html.j2``), with autoescape on and nothing
marked safe, so model and trace text stays text; every value the template prints passes
through ``visible`` first (its ``finalize``), so no control or bidi character reaches the page
raw."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import jinja2

from replay.present.formatting import DASH, f_int, text, visible
from replay.present.reading import Run
from replay.present.sections import build_views, shown_sections

TEMPLATE = "report_template.html.j2"


def _header(run: Run) -> dict[str, Any]:
    m, trace = run.manifest, run.manifest.trace
    started = m.started_at
    return {
        "run_id": run.dir.name,
        "started": DASH
        if started is None
        else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "tool": f"{text(m.tool.name)} {text(m.tool.version)}",
        "trace": text(trace.path),
        "sha": _f_sha(trace.sha256),
        "requests": f_int(trace.requests),
        "bad_lines": f_int(trace.bad_lines),
        "buckets": ", ".join(m.buckets.labels) or DASH,
        "schedules": ", ".join(m.schedules) or DASH,
        "command": " ".join(m.command) or DASH,
        "summary_version": text(run.summary.version),
    }


def _f_sha(x: object) -> str:
    return f"{x[:12]}…" if isinstance(x, str) and x else DASH


def _finalize(value: object) -> object:
    """Every printed value: text made visible; a macro's output (markup built from values
    that already went through here) as it is."""
    if isinstance(value, str) and not hasattr(value, "__html__"):  # Markup has it
        return visible(value)
    return value


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_finalize,
    )
    env.globals["DASH"] = DASH
    return env


def html_report(run: Run) -> str:
    """The full HTML page of a run."""
    views, problems = build_views(run)
    return (
        _environment()
        .get_template(TEMPLATE)
        .render(h=_header(run), sections=shown_sections(views), v=views, problems=problems)
    )
