"""Saturation in a load sweep (``replay/analysis/saturation.py``) and the report's load section,
from hand-made summaries: each level is a phase of 100 s whose figures are given here."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.analysis.saturation import (
    KNEE_RULE,
    KneeRule,
    knee_of,
    phase_load,
    saturated,
    saturation_of,
    sweep_of,
)
from replay.analysis.schemas import Summary
from replay.analysis.schemas.sweep import LoadCurve, Saturation
from replay.present import report

DURATION = 100.0
Level = tuple[str, float | None, float]  # (phase label, TTFT p90 in ms, successful req/s)


def _figures(
    ttft: float | None, rps: float, queue: float = 0.0, attainment: float | None = None
) -> dict[str, Any]:
    ok = round(rps * DURATION)
    figures: dict[str, Any] = {
        "requests": ok,
        "ok": ok,
        "output_tokens": 64 * ok,
        "ttft_ms": {"p50": None if ttft is None else 0.6 * ttft, "p90": ttft},
        "queue_delay_ms": {"p50": queue / 2, "p90": queue},
    }
    if attainment is not None:
        figures["slo"] = {
            "bounds_ms": {"ttft_ms": 500.0},
            "sent": ok,
            "met": round(ok * attainment),
            "attainment": attainment,
            "met_by_metric": {},
            "goodput_rps": rps * attainment,
        }
    return figures


def _summary(
    targets: dict[str, list[Level]],
    queue: dict[str, list[float]] | None = None,
    attainment: dict[str, list[float]] | None = None,
    buckets: dict[str, dict[str, list[Level]]] | None = None,
) -> Summary:
    """A summary whose targets ran the given levels; ``queue`` and ``attainment`` give each
    level's queue-delay p90 and SLO attainment, ``buckets`` each bucket's own levels."""
    doc: dict[str, Any] = {"version": 3, "targets": {}}
    for name, levels in targets.items():
        phases = {}
        for i, (label, ttft, rps) in enumerate(levels):
            q = (queue or {}).get(name, [0.0] * len(levels))[i]
            a = (attainment or {}).get(name)
            per_bucket = {
                b: _figures(bt, br, attainment=a[i] if a else None)
                for b, blevels in (buckets or {}).get(name, {}).items()
                for bl, bt, br in blevels
                if bl == label
            }
            phases[label] = {
                "duration_s": DURATION,
                "all": _figures(ttft, rps, q, a[i] if a else None),
                "buckets": per_bucket,
            }
        doc["targets"][name] = {"status": "ok", "phases": phases}
    return Summary.from_json(doc)


def _labels(levels: list[Level]) -> list[str]:
    return [label for label, _, _ in levels]


def _curve(levels: list[Level], **kw: Any) -> LoadCurve:
    sat = saturation_of(_summary({"t": levels}, **kw), _labels(levels))
    assert sat is not None
    return sat.targets["t"].all


CLEAN_KNEE: list[Level] = [("c1", 50.0, 1.0), ("c4", 52.0, 3.9), ("c16", 55.0, 15.0)]
CLEAN_KNEE += [("c64", 300.0, 20.0)]


# -- phase labels and sweeps ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "load"),
    [
        ("c1", ("concurrency", 1.0)),
        ("c64", ("concurrency", 64.0)),
        ("poisson-2rps", ("rate", 2.0)),
        ("poisson-0.5rps", ("rate", 0.5)),
        ("poisson-1e+03rps", ("rate", 1000.0)),
        ("c0", None),
        ("C4", None),
        ("c4x", None),
        ("poisson-0rps", None),
        ("poisson-xrps", None),
        ("trace", None),
        ("", None),
    ],
)
def test_phase_labels_name_their_load(label: str, load: tuple[str, float] | None) -> None:
    assert phase_load(label) == load


def test_a_sweep_is_one_kind_in_rising_load() -> None:
    assert sweep_of(["c16", "c1", "c4"]) == (
        "concurrency",
        [("c1", 1.0), ("c4", 4.0), ("c16", 16.0)],
    )
    assert sweep_of(["trace", "c1", "poisson-2rps", "c4"]) == (
        "concurrency",
        [("c1", 1.0), ("c4", 4.0)],
    )
    assert sweep_of(["poisson-2rps", "poisson-2.0rps", "poisson-4rps"]) == (
        "rate",
        [("poisson-2rps", 2.0), ("poisson-4rps", 4.0)],
    )


@pytest.mark.parametrize(
    "labels", [[], ["trace"], ["c4"], ["poisson-2rps"], ["c4", "trace"], ["c4", "poisson-2rps"]]
)
def test_not_a_sweep_has_no_saturation(labels: list[str]) -> None:
    summary = _summary({"t": [(label, 50.0, 1.0) for label in labels]})
    assert saturation_of(summary, labels) is None


# -- the knee ---------------------------------------------------------------------------------


def test_a_clean_knee_is_the_last_level_before_latency_turns_up() -> None:
    curve = _curve(CLEAN_KNEE)
    assert [p.load for p in curve.points] == [1.0, 4.0, 16.0, 64.0]
    assert curve.knee is not None
    assert (curve.knee.phase, curve.knee.load, curve.knee.metric) == ("c16", 16.0, "ttft_p90_ms")
    assert "TTFT p90 rose from 55 to 300 ms, c16 to c64" in curve.knee.reason
    # Throughput grew 33% for 300% more load as well: both are named.
    assert "throughput rose 33%" in curve.knee.reason
    # Without the last level the bend is not there yet.
    assert knee_of(curve.points[:3]) is None


def test_a_knee_lower_down_holds_at_every_level_above_it() -> None:
    levels: list[Level] = [("c1", 50.0, 1.0), ("c4", 52.0, 3.9), ("c16", 300.0, 12.0)]
    curve = _curve([*levels, ("c64", 900.0, 16.0)])
    assert curve.knee is not None and curve.knee.phase == "c4"


def test_no_knee_within_the_sweep() -> None:
    levels: list[Level] = [("c1", 40.0, 1.0), ("c4", 44.0, 3.9), ("c16", 52.0, 15.0)]
    levels += [("c64", 70.0, 55.0)]
    assert _curve(levels).knee is None
    # A steady climb is not a bend however far it goes: the slope never grows 3x.
    steady: list[Level] = [(f"c{n}", 50.0 + 10.0 * n, float(n)) for n in (1, 2, 4, 8)]
    assert _curve(steady).knee is None


def test_a_noisy_flat_curve_has_no_false_knee() -> None:
    rng = random.Random(7)
    for _ in range(200):
        levels: list[Level] = [
            (f"c{n}", 50.0 * rng.uniform(0.85, 1.15), n * rng.uniform(0.9, 1.1))
            for n in (1, 2, 4, 8, 16)
        ]
        queue = {"t": [rng.uniform(0.0, 2.0) for _ in levels]}  # closed loop: about zero
        assert _curve(levels, queue=queue).knee is None, levels


def test_one_noisy_level_is_not_a_knee() -> None:
    levels: list[Level] = [("c1", 50.0, 1.0), ("c4", 120.0, 3.9), ("c16", 55.0, 15.0)]
    levels += [("c64", 60.0, 58.0)]
    assert _curve(levels).knee is None
    dip: list[Level] = [("c1", 50.0, 1.0), ("c4", 51.0, 1.2), ("c16", 52.0, 15.0)]
    assert _curve(dip).knee is None  # throughput came back at c16


def test_throughput_collapse_is_a_knee() -> None:
    levels: list[Level] = [("c1", 50.0, 1.0), ("c4", 55.0, 3.8), ("c16", 60.0, 12.0)]
    levels += [("c64", 65.0, 6.0)]
    curve = _curve(levels)
    assert curve.knee is not None
    assert (curve.knee.phase, curve.knee.metric) == ("c16", "throughput_rps")
    assert curve.knee.reason.startswith("throughput fell 50% (12 to 6 req/s)")


def test_rate_labels_and_queue_delay() -> None:
    levels: list[Level] = [("poisson-0.5rps", 200.0, 0.5), ("poisson-1rps", 210.0, 1.0)]
    levels += [("poisson-2rps", 230.0, 2.0), ("poisson-4rps", 2000.0, 3.1)]
    sat = saturation_of(_summary({"t": levels}), _labels(levels))
    assert sat is not None and sat.kind == "rate"
    assert sat.phases == ("poisson-0.5rps", "poisson-1rps", "poisson-2rps", "poisson-4rps")
    knee = sat.targets["t"].all.knee
    assert knee is not None and (knee.phase, knee.load) == ("poisson-2rps", 2.0)
    # An open loop held at a cap on requests in flight queues at the client instead.
    flat: list[Level] = [(label, 200.0, rps) for label, _, rps in levels]
    curve = _curve(flat, queue={"t": [1.0, 2.0, 3.0, 900.0]})
    assert curve.knee is not None and curve.knee.metric == "queue_delay_p90_ms"


def test_buckets_have_their_own_curves() -> None:
    long: list[Level] = [("c1", 900.0, 0.2), ("c4", 3000.0, 0.25), ("c16", 12000.0, 0.26)]
    short: list[Level] = [("c1", 40.0, 0.8), ("c4", 42.0, 3.6), ("c16", 45.0, 14.0)]
    summary = _summary({"t": CLEAN_KNEE}, buckets={"t": {"<8K": short, ">=8K": long}})
    sat = saturation_of(summary, _labels(CLEAN_KNEE))
    assert sat is not None
    curves = sat.targets["t"].buckets
    assert list(curves) == ["<8K", ">=8K"]
    assert curves["<8K"].knee is None
    assert [p.phase for p in curves[">=8K"].points] == ["c1", "c4", "c16"]  # no c64 there
    k = curves[">=8K"].knee
    assert k is not None and k.phase == "c1" and k.metric == "ttft_p90_ms"
    assert curves[">=8K"].points[0].throughput_out_tok_s == pytest.approx(0.2 * 64)


def test_the_rule_is_a_parameter_and_is_recorded() -> None:
    sat = saturation_of(_summary({"t": CLEAN_KNEE}), _labels(CLEAN_KNEE))
    assert sat is not None and sat.rule == KNEE_RULE.to_json()
    assert sat.rule["slope_multiple"] == 3.0
    strict = KneeRule(min_rise=10.0, throughput_fraction=0.0)  # a 10x rise, and a fall
    loose = saturation_of(_summary({"t": CLEAN_KNEE}), _labels(CLEAN_KNEE), rule=strict)
    assert loose is not None and loose.targets["t"].all.knee is None
    with pytest.raises(ValueError, match="attainment"):
        saturation_of(_summary({"t": CLEAN_KNEE}), _labels(CLEAN_KNEE), attainment=90)


# -- the SLOs ---------------------------------------------------------------------------------


def test_the_highest_load_meeting_the_slos() -> None:
    attainment = {"t": [0.99, 0.95, 0.85, 0.95]}
    curve = _curve(CLEAN_KNEE, attainment=attainment)
    ceiling = curve.max_load_meeting_slo
    assert ceiling is not None
    # c64 meets them again: noise after a level that failed, not headroom.
    assert (ceiling.attainment, ceiling.phase, ceiling.load) == (0.9, "c4", 4.0)
    assert curve.points[2].slo_attainment == 0.85
    assert curve.points[2].goodput_rps == pytest.approx(15.0 * 0.85)
    summary = _summary({"t": CLEAN_KNEE}, attainment=attainment)
    lower = saturation_of(summary, _labels(CLEAN_KNEE), attainment=0.8)
    assert lower is not None and lower.attainment == 0.8
    c = lower.targets["t"].all.max_load_meeting_slo
    assert c is not None and (c.phase, c.load) == ("c64", 64.0)
    none_met = _curve(CLEAN_KNEE, attainment={"t": [0.5, 0.9, 0.9, 0.9]}).max_load_meeting_slo
    assert none_met is not None and (none_met.phase, none_met.load) == (None, None)


def test_without_slos_there_is_no_ceiling_and_no_key() -> None:
    curve = _curve(CLEAN_KNEE)
    assert curve.max_load_meeting_slo is None
    assert "max_load_meeting_slo" not in curve.to_json()
    assert "slo_attainment" not in curve.points[0].to_json()


# -- saturated: may the sweep stop rising? ----------------------------------------------------


def test_saturated_once_a_knee_is_passed_without_slos() -> None:
    curve = _curve(CLEAN_KNEE)
    assert saturated(curve)
    sat = saturation_of(_summary({"t": CLEAN_KNEE[:3]}), _labels(CLEAN_KNEE[:3]))
    assert sat is not None and not saturated(sat.targets["t"])  # a TargetSaturation: totals
    assert not saturated(LoadCurve(points=curve.points[:1], knee=None))


def test_saturated_with_slos_when_the_last_level_misses_them() -> None:
    met = _curve(CLEAN_KNEE, attainment={"t": [0.99, 0.99, 0.97, 0.95]})
    assert not saturated(met)  # past the knee but still within the SLOs: keep rising
    missed = _curve(CLEAN_KNEE, attainment={"t": [0.99, 0.99, 0.97, 0.6]})
    assert saturated(missed)
    assert not saturated(missed, attainment=0.5)
    # Missing the SLOs without a knee is not saturation: the SLOs may just be strict.
    strict = _curve(CLEAN_KNEE[:3], attainment={"t": [0.5, 0.5, 0.5]})
    assert not saturated(strict)


def test_saturated_when_throughput_falls() -> None:
    # Every level within the SLOs: only the fall itself can stop the sweep.
    within = {"t": [0.99, 0.99, 0.99]}
    levels: list[Level] = [("c1", 50.0, 1.0), ("c4", 52.0, 4.0), ("c8", 53.0, 3.5)]
    assert saturated(_curve(levels, attainment=within))  # 12.5% below c4's
    levels[-1] = ("c8", 53.0, 3.7)  # 7.5% below: noise
    assert not saturated(_curve(levels, attainment=within))


# -- the records --------------------------------------------------------------------------------


def test_saturation_reads_back_and_stays_out_of_summaries_without_it() -> None:
    summary = _summary({"t": CLEAN_KNEE}, attainment={"t": [0.99, 0.95, 0.85, 0.95]})
    assert "saturation" not in summary.to_json()
    sat = saturation_of(summary, _labels(CLEAN_KNEE))
    assert sat is not None
    doc = orjson.loads(orjson.dumps(sat.to_json()))
    assert Saturation.from_json(doc) == sat
    with_sat = Summary.from_json({**summary.to_json(), "saturation": doc})
    assert with_sat.saturation == sat


# -- the report -------------------------------------------------------------------------------


def _run_dir(tmp_path: Path, summary: Summary, sat: Saturation | None) -> Path:
    run = tmp_path / "run1"
    run.mkdir()
    doc = summary.to_json()
    if sat is not None:
        doc["saturation"] = sat.to_json()
    manifest = {
        "schedules": list(sat.phases if sat else ()),
        "buckets": {"labels": ["<8K", ">=8K"]},
        "reference": "bf16",
    }
    for name, content in (("summary.json", doc), ("manifest.json", manifest)):
        (run / name).write_bytes(orjson.dumps(content, option=orjson.OPT_SORT_KEYS))
    return run


def _sweep_run(tmp_path: Path) -> Path:
    fp8 = [*CLEAN_KNEE[:3], ("c64", 640.0, 16.0)]
    long: list[Level] = [("c1", 900.0, 0.2), ("c4", 3000.0, 0.25), ("c16", 12000.0, 0.26)]
    short: list[Level] = [("c1", 40.0, 0.8), ("c4", 42.0, 3.6), ("c16", 45.0, 14.0)]
    summary = _summary(
        {"bf16": CLEAN_KNEE, "fp8": fp8},
        attainment={"bf16": [0.99, 0.98, 0.95, 0.5], "fp8": [0.99, 0.97, 0.92, 0.3]},
        buckets={"fp8": {">=8K": long, "<8K": short}},
    )
    sat = saturation_of(summary, _labels(CLEAN_KNEE))
    return _run_dir(tmp_path, summary, sat)


def test_the_report_has_a_load_section_with_the_knee(tmp_path: Path) -> None:
    from tests.unit.present.test_report import sections

    html = report.render_html(_sweep_run(tmp_path))
    assert '<a href="#load">Load</a>' in html
    assert html.index('<section id="latency"') < html.index('<section id="load"')
    assert html.index('<section id="load"') < html.index('<section id="capacity"')
    s = sections(html)
    assert "could not be rendered" not in html
    assert "bf16 knee c16" in s.text["load"] and "fp8 knee c16" in s.text["load"]
    load = html[html.index('<section id="load"') : html.index('<section id="capacity"')]
    assert load.count("<svg") == 3  # all requests, and fp8's two buckets
    rows = s.rows["load"]
    knees = {(r[0], r[1]): r for r in rows if len(r) == 5}
    assert knees[("fp8", "all")][2:3] == ["c16 (16)"]
    assert knees[("fp8", ">=8K")][2] == "c1 (1)" and knees[("fp8", "<8K")][2:] == [
        "no knee within the sweep",
        "—",
        "c16 (16)",
    ]
    assert knees[("bf16", "all")][4] == "c16 (16)"
    levels = [r for r in rows if r[:3] == ["fp8", "16", "c16"]]
    figures = ["15.0", "960", "33.0 / 55.0", "0.00", "92.0%", "13.8"]
    assert levels == [["fp8", "16", "c16", *figures, "knee; highest meeting the SLOs"]]
    # Buckets in the run's order, not the file's sorted keys.
    assert [r[0] for r in rows if r[0] in ("<8K", ">=8K")][:1] == ["<8K"]


def test_the_markdown_report_has_the_load_tables(tmp_path: Path) -> None:
    text = report.render_markdown(_sweep_run(tmp_path))
    assert "### Load: knee and SLO ceiling per bucket" in text
    assert "| fp8 | all | c16 (16) | TTFT p90 rose from 55 to 640 ms, c16 to c64" in text
    assert "| fp8 | &gt;=8K | c1 (1) |" in text
    assert "### Load: each level" in text
    assert "| bf16 | 64 | c64 | 20.0 | 1,280 | 180 / 300 | 0.00 | 50.0% | 10.0 |  |" in text


def test_no_sweep_no_load_section(tmp_path: Path) -> None:
    summary = _summary({"bf16": [("c4", 50.0, 4.0)]})
    run = _run_dir(tmp_path, summary, saturation_of(summary, ["c4"]))
    html = report.render_html(run)
    assert 'id="load"' not in html and "#load" not in html
    assert "Load" not in report.render_markdown(run)


def test_odd_saturation_values_never_crash(tmp_path: Path) -> None:
    from tests.unit.present.test_report import _junk_copies, _paths

    run = _sweep_run(tmp_path)
    doc = orjson.loads((run / "summary.json").read_bytes())
    paths = [("saturation", *p) for p in _paths(doc["saturation"])]
    for path, junk, copy in _junk_copies(doc, paths, random.Random(3)):
        (run / "summary.json").write_bytes(orjson.dumps(copy))
        assert "could not be rendered" not in report.render_html(run), (path, junk)
        report.render_markdown(run)
