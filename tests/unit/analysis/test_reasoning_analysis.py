"""Reasoning in the analysis: grading reads the answer only, an answer cut while reasoning
is graded as the empty answer it is and says so, and a target that reasons longer than the
reference beyond the A/A floor is an early warning in the verdict's evidence (never a
decision)."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from replay.analysis.grading.rows import grade_rows, no_answer
from replay.analysis.reasoning import reasoning_length
from replay.analysis.schemas import ReasoningDelta, Summary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.summary import summarize_targets
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import ArmFacts, facts_from_run
from replay.analysis.verdict.rule import decide, reasoning_warnings
from replay.core.records import Result
from replay.pipeline.reanalyse import reanalyse
from replay.present import report
from replay.traces.trace import Request
from tests.unit.present.test_report import make_run_dir, sections

BUCKETS = ["<256", "256-1K"]
CHECK = {"type": "contains", "values": ["42"]}


def answer(target: str, rid: str, bucket: str, reasoning: int, text: str = "It is 42.") -> Result:
    r = Result(rid, target, "c1", bucket, 0.0, sent=0.0, first_token=0.1, done=1.0)
    r.output_text, r.reasoning_text = text, "let me think " * 3
    r.reasoning_tokens, r.output_tokens = reasoning, reasoning + 5
    r.first_answer_token = 0.1 + 0.01 * reasoning if text else None
    r.finish_reason = "stop" if text else "length"
    return r


def test_grading_reads_the_answer_not_the_reasoning() -> None:
    req = Request(id="q", messages=({"role": "user", "content": "?"},), check=CHECK)
    thought = answer("bf16", "q", "<256", 30, text="I cannot say.")
    thought.reasoning_text = "the answer is 42"  # right in the reasoning, not in the answer
    cut = answer("bf16", "q", "<256", 64, text="")
    rows = grade_rows([thought], {"q": req}, "bf16")
    assert rows[0]["grade"]["passed"] is False
    (row,) = grade_rows([cut], {"q": req}, "bf16")
    assert row["answered"] and row["grade"]["passed"] is False
    assert row["grade"]["reason"].startswith(
        "no answer: 64 reasoning tokens and then none (finish_reason length); "
    )
    assert no_answer(answer("bf16", "q", "<256", 30)) is None


def run(longer: dict[str, float], seed: int = 7) -> list[Result]:
    """bf16, its A/A control and fp8: 20 requests a bucket, reasoning about 100 tokens with
    the control's noise; fp8 reasons ``longer[bucket]`` times as long."""
    rng = random.Random(seed)
    out = []
    for bucket in BUCKETS:
        for i in range(20):
            rid, base = f"{bucket}-{i}", rng.randint(60, 140)
            out.append(answer("bf16", rid, bucket, base))
            out.append(answer("bf16-control", rid, bucket, base + rng.randint(-6, 6)))
            fp8 = round(base * longer.get(bucket, 1.0)) + rng.randint(-6, 6)
            out.append(answer("fp8", rid, bucket, fp8))
    return out


def verdict_evidence(results: list[Result]) -> list[str]:
    names = ("bf16", "bf16-control", "fp8")
    info = {n: {"status": "ok", "phases": {"c1": {"start": 0.0, "end": 10.0}}} for n in names}
    summary = Summary(
        version=1,
        targets=summarize_targets(results, info, {}, BUCKETS),
        reasoning=reasoning_length(results, "bf16", BUCKETS),
    )
    manifest = {"targets": {n: {"name": n} for n in names}, "reference": "bf16"}
    facts = facts_from_run(summary, Manifest.from_json(manifest), candidate="fp8")
    return [e["text"] for e in decide(facts).evidence if e["kind"] == "warning"]


def test_a_target_that_reasons_longer_beyond_the_floor_is_warned_about() -> None:
    results = run({"256-1K": 1.4})
    length = reasoning_length(results, "bf16", BUCKETS)
    assert length is not None and length.control == "bf16-control"
    fp8 = length.phases["c1"]["fp8"]
    assert list(fp8) == BUCKETS and fp8["256-1K"].pairs == 20
    assert fp8["256-1K"].delta_mean == pytest.approx(40, abs=10)
    assert fp8["256-1K"].floor_hi is not None and fp8["256-1K"].floor_hi < 5
    (warning,) = verdict_evidence(results)
    assert warning.startswith("fp8 in 256-1K: reasons longer than the reference")
    assert "A/A floor up to" in warning and "early warning only" in warning


def test_no_warning_within_the_floor_or_without_reasoning() -> None:
    assert verdict_evidence(run({})) == []
    plain = [answer(r.target, r.request_id, r.bucket, 0) for r in run({})]
    assert reasoning_length(plain, "bf16", BUCKETS) is None


@pytest.mark.parametrize(
    ("delta", "floor_hi", "pairs", "warns"),
    [
        ((30.0, 20.0, 40.0), 5.0, 20, True),  # beyond the floor and 10% of 100
        ((30.0, 20.0, 40.0), 25.0, 20, False),  # the A/A control moves as much
        ((8.0, 6.0, 10.0), None, 20, False),  # under 10% of the reference's mean
        ((30.0, 20.0, 40.0), None, 20, True),  # no control: beyond zero and 10%
        ((30.0, 20.0, 40.0), 5.0, 4, False),  # too few pairs
        ((-30.0, -40.0, -20.0), 5.0, 20, False),  # reasons shorter: no cost
    ],
)
def test_the_reasoning_warning_rule(
    delta: tuple[float, float, float], floor_hi: float | None, pairs: int, warns: bool
) -> None:
    d = ReasoningDelta(
        pairs=pairs,
        reference_mean=100.0,
        target_mean=100.0 + delta[0],
        delta_mean=delta[0],
        lo=delta[1],
        hi=delta[2],
        floor_hi=floor_hi,
    )
    arm = ArmFacts("fp8", reasoning=((None, "<256", d),))
    assert bool(reasoning_warnings(arm, Thresholds())) == warns


def test_the_report_shows_time_to_answer_reasoning_and_the_warning(tmp_path: Path) -> None:
    """The report's latency table gains the time to the first answer token and the median
    reasoning length per bucket, and the verdict's evidence the warning (the run re-analysed
    from its results, as ``replay analyze`` does)."""
    run_dir = make_run_dir(tmp_path)
    rows = [orjson.loads(line) for line in (run_dir / "results.jsonl").read_bytes().splitlines()]
    for row in rows:
        longer = row["target"] == "fp8" and row["bucket"] == "256-1K"
        row["reasoning_tokens"] = (130 if longer else 100) + int(row["request_id"][1:]) % 5
        if row["first_token"] is not None:
            row["first_answer_token"] = row["first_token"] + 0.5
    (run_dir / "results.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    reanalyse(run_dir, tmp_path / "trace.jsonl")
    latency = sections(report.render_html(run_dir)).text["latency"]
    assert "First answer token p50 / p90 (ms)" in latency and "Reasoning tokens median" in latency
    text = report.render_markdown(run_dir)
    assert "fp8 in 256-1K: reasons longer than the reference" in text
    assert "fp8 in <256: reasons longer" not in text
