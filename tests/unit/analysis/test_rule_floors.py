"""Each derived rule's A/A floor per phase, and the demotion of a rule that grades noise."""

from __future__ import annotations

from typing import Any

from replay.analysis.grading.quality import assess_quality
from replay.analysis.grading.rule_floors import MIN_GRADED, NOISY_BELOW


def row(target: str, rid: str, rule: str, passed: bool | None) -> dict[str, Any]:
    derived = None if target == "bf16" else {"rule": rule, "passed": passed, "exact": passed}
    return {
        "phase": "c4",
        "target": target,
        "request_id": rid,
        "bucket": "<1K",
        "answered": True,
        "grade": None,
        "derived": derived,
        "agreement": None,
    }


def rows(n_facts: int, control_facts_pass: int) -> list[dict[str, Any]]:
    """``n_facts`` facts requests the control passes ``control_facts_pass`` of and fp8 all of;
    30 code requests the control passes and fp8 fails a third of."""
    out = []
    for i in range(n_facts):
        rid = f"f{i}"
        out += [
            row("bf16", rid, "derived:facts", None),
            row("bf16-control", rid, "derived:facts", i < control_facts_pass),
            row("fp8", rid, "derived:facts", True),
        ]
    for i in range(30):
        rid = f"c{i}"
        out += [
            row("bf16", rid, "derived:code", None),
            row("bf16-control", rid, "derived:code", True),
            row("fp8", rid, "derived:code", i % 3 != 0),
        ]
    return out


def test_a_rule_whose_floor_is_noise_is_shown_and_demoted() -> None:
    q = assess_quality(rows(MIN_GRADED + 10, 12), [], "bf16", ["<1K"]).to_json()
    facts, code = q["rules"]["c4"]["derived:facts"], q["rules"]["c4"]["derived:code"]
    assert (facts["graded"], facts["passed"], facts["requests"]) == (30, 12, 60)
    assert facts["floor"] == 0.4 < NOISY_BELOW and facts["demoted"] is True
    assert facts["targets"]["fp8"] == {"graded": 30, "passed": 30, "ungraded": 0}
    assert (code["floor"], code["demoted"]) == (1.0, False)
    assert code["targets"]["fp8"]["passed"] == 20
    # Only the code rule's pairs decide: fp8's facts "wins" over a noisy control are gone.
    combined = q["phases"]["c4"]["fp8"]["buckets"]["<1K"]["combined"]
    assert (combined["derived"], combined["ref_only"], combined["target_only"]) == (30, 10, 0)
    assert any("demoted" in n and "derived:facts (12/30)" in n for n in q["notes"])


def test_a_low_floor_over_few_answers_is_shown_but_not_demoted() -> None:
    q = assess_quality(rows(MIN_GRADED - 1, 5), [], "bf16", ["<1K"]).to_json()
    facts = q["rules"]["c4"]["derived:facts"]
    assert facts["floor"] < NOISY_BELOW and facts["demoted"] is False
    combined = q["phases"]["c4"]["fp8"]["buckets"]["<1K"]["combined"]
    assert combined["derived"] == MIN_GRADED - 1 + 30
    assert not any("demoted" in n for n in q["notes"])


def test_without_a_control_there_is_no_floor() -> None:
    no_control = [r for r in rows(30, 30) if r["target"] != "bf16-control"]
    assert "rules" not in assess_quality(no_control, [], "bf16", ["<1K"]).to_json()  # no floor
