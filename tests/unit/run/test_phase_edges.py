"""A phase's edges wait, briefly, for the server's figures to settle: an idle server at the
start, and at the end a finished count that holds every answer the phase got."""

from __future__ import annotations

import asyncio

import pytest

from replay.analysis.summary import summarize_server
from replay.run import phase
from replay.serving.metrics import MetricsSnapshot


class Scripted:
    """/metrics as a list of pages, one per scrape; the last one repeats."""

    def __init__(self, *pages: dict[str, float]) -> None:
        self.pages, self.scrapes = list(pages), 0

    async def scrape_once(self) -> MetricsSnapshot | None:
        page = self.pages[min(self.scrapes, len(self.pages) - 1)]
        self.scrapes += 1
        snap = MetricsSnapshot(t=float(self.scrapes))
        snap.values = {k: v for k, v in page.items() if k != "finished"}
        if "finished" in page:
            snap.histograms["e2e"] = {"sum": 0.0, "count": page["finished"], "buckets": {}}
        return snap


def test_the_end_edge_waits_for_the_last_answer_to_be_counted() -> None:
    before = MetricsSnapshot(t=0.0, histograms={"e2e": {"sum": 0.0, "count": 10.0}})
    s = Scripted({"finished": 39}, {"finished": 39}, {"finished": 40})
    after = asyncio.run(phase.scrape_caught_up(s, before, answered=30))
    assert s.scrapes == 3 and after is not None and after.t == 3.0


def test_the_start_edge_waits_for_an_idle_server() -> None:
    s = Scripted({"running": 1, "waiting": 2}, {"running": 1}, {"running": 0, "waiting": 0})
    assert asyncio.run(phase.scrape_idle(s)) is not None and s.scrapes == 3


@pytest.mark.parametrize(
    "pages",
    [
        ({"running": 4},),  # another client keeps the server busy
        ({"finished": 5},),  # the server counts fewer than we were answered
    ],
)
def test_an_edge_that_never_settles_gives_up_after_its_bound(
    monkeypatch: pytest.MonkeyPatch, pages: tuple[dict[str, float], ...]
) -> None:
    monkeypatch.setattr(phase, "SETTLE_S", 0.2)
    s = Scripted(*pages)
    before = MetricsSnapshot(t=0.0, histograms={"e2e": {"sum": 0.0, "count": 0.0}})
    edge = phase.scrape_idle(s) if "running" in pages[0] else phase.scrape_caught_up(s, before, 9)
    assert asyncio.run(edge) is not None
    assert s.scrapes >= 2  # it polled, gave up at its bound, and the phase goes on


def test_a_server_without_vllms_figures_is_not_waited_for() -> None:
    s = Scripted({})
    assert asyncio.run(phase.scrape_caught_up(s, MetricsSnapshot(t=0.0), answered=3))
    assert asyncio.run(phase.scrape_idle(s)) is not None and s.scrapes == 2


def test_the_summary_counts_what_the_server_finished_in_the_phase() -> None:
    series = [
        {"t": 1.0, "e2e_hist": {"sum": 1.0, "count": 10}},
        {"t": 2.0, "e2e_hist": {"sum": 4.0, "count": 40}},
    ]
    srv = summarize_server(series, 1.0, 2.0)
    assert srv.server_finished == 30 and srv.server_e2e_mean_ms == pytest.approx(100.0)
    assert summarize_server([{"t": 1.0}, {"t": 2.0}], 1.0, 2.0).server_finished is None
