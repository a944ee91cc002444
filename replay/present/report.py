"""Reports of a run directory: one self-contained HTML file and a Markdown summary.

The HTML report opens without network access: CSS is inline, the charts are inline SVG
(drawn by ``charts``), there is no script, and a Content-Security-Policy forbids loading
anything. It puts the verdict and its evidence first, then the serving path, quality per
bucket (intervals, noise floor), the systems comparison, latency distributions, capacity, KV
usage over time and a per-request drill-down. The Markdown report (for a PR comment) has the
verdict, its evidence, the serving-path findings and per-bucket quality and latency tables.

Model and trace text is data: the template autoescapes everything, and nothing here marks text
as safe. Charts are lists of plain shapes (``Shape``) that the template draws, so labels in
them are escaped too. Any file or key may be missing (older or partial runs): a missing value
renders as a dash, a missing section says "not measured in this run", and a section whose data
has an unexpected shape says so instead of failing the whole report.

The pieces: ``reading`` reads the run directory, one module of ``views`` per group of sections
builds their views (``views.Table`` for tables, ``charts`` for SVG, ``formatting`` for every
number), ``sections`` puts them in order, and ``html`` and ``markdown`` render them.
"""

from __future__ import annotations

from pathlib import Path

from replay.analysis.result_table import ResultTable
from replay.present.html import html_report
from replay.present.markdown import markdown_report
from replay.present.reading import load_run
from replay.rundir.files import write_text


def render_html(run_dir: Path) -> str:
    """The full, self-contained HTML report of a run directory."""
    return html_report(load_run(Path(run_dir)))


def render_markdown(run_dir: Path) -> str:
    """Verdict, evidence, serving-path findings and per-bucket tables, for a PR comment."""
    return markdown_report(load_run(Path(run_dir)))


def write_reports(run_dir: Path, results: ResultTable | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into the run directory; return both paths.
    ``results``: the run's results as the analysis just read them (``load_run``)."""
    run_dir = Path(run_dir)
    run = load_run(run_dir, results)
    html_path, md_path = run_dir / "report.html", run_dir / "report.md"
    write_text(html_path, html_report(run))  # whole or not at all; RunDirError when it cannot
    write_text(md_path, markdown_report(run))
    return html_path, md_path
