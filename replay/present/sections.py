"""The report's sections: their order and titles (the HTML report's navigation) and the
function that builds each one's view from a ``Run``. An optional section (``OPTIONAL``) is
left out altogether, navigation included, when its run has nothing for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from replay.present.reading import Run
from replay.present.views.load import load_view
from replay.present.views.quality import quality_view
from replay.present.views.requests import requests_view
from replay.present.views.sequential import sequential_view
from replay.present.views.systems import capacity_view, kv_view, latency_view, systems_view
from replay.present.views.verdict import serving_view, verdict_view
from replay.present.views.workers import workers_view

SECTIONS = (
    ("verdict", "Verdict"),
    ("serving", "Serving path"),
    ("quality", "Quality"),
    ("systems", "Systems"),
    ("latency", "Latency"),
    ("load", "Load"),
    ("sequential", "Sequential"),
    ("capacity", "Capacity"),
    ("kv-usage", "KV usage"),
    ("workers", "Workers"),
    ("requests", "Requests"),
)
BUILDERS: dict[str, Callable[[Run], Any]] = {
    "verdict": verdict_view,
    "serving": serving_view,
    "quality": quality_view,
    "systems": systems_view,
    "latency": latency_view,
    "load": load_view,
    "sequential": sequential_view,
    "capacity": capacity_view,
    "kv-usage": kv_view,
    "workers": workers_view,
    "requests": requests_view,
}

# Sections only some runs have (a load sweep, a distributed Locust run's workers): absent
# rather than "not measured".
OPTIONAL = frozenset({"load", "sequential", "workers"})


def build_views(run: Run, keys: Iterable[str] = BUILDERS) -> tuple[dict[str, Any], list[str]]:
    """Each section's view, and the problems reading the run: a section whose data has an
    unexpected shape is reported there (and left out) rather than losing the whole report."""
    views: dict[str, Any] = {}
    problems = list(run.problems)
    for key in keys:
        try:
            views[key] = BUILDERS[key](run)
        except Exception as exc:  # one bad section must not lose the report
            views[key] = None
            problems.append(f"section '{key}' could not be rendered: {exc!r}")
    return views, problems


def shown_sections(views: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The sections the report shows, in order: an optional one only when it has a view."""
    return [(key, title) for key, title in SECTIONS if key not in OPTIONAL or views.get(key)]
