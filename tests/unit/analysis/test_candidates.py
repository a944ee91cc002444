"""Several candidates in one run: each decided on its own, at alpha / k, in its format's
words (replay/analysis/verdict/candidates.py)."""

from __future__ import annotations

from typing import Any

from replay.analysis.schemas import Summary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.candidates import decide_candidates, format_of, in_its_words
from replay.analysis.verdict.wording import verdict_record
from tests.unit.analysis.test_verdict import _row


def _summary(cells: dict[str, tuple[int, int, int]]) -> Summary:
    """One phase, one bucket: per candidate (pairs, lost, gained) against bf16, each holding
    twice the reference's cache."""
    rows = {
        name: {"buckets": {"<8K": _row(*c)}, "shift": {"p_value": 1.0, "direction": "none"}}
        for name, c in cells.items()
    }
    targets: dict[str, Any] = {"bf16": {"status": "ok", "kv_cache_size_tokens": 1000, "phases": {}}}
    for name in cells:
        dtype = name.removesuffix("-emulated")
        targets[name] = {
            "status": "ok",
            "cache_dtype": "auto" if name.endswith("-emulated") else dtype,
            "kv_cache_size_tokens": 2000,
            "phases": {},
        }
    data = {"quality": {"reference": "bf16", "phases": {"c1": rows}}, "targets": targets}
    return Summary.from_json(data)


def _manifest_json(*names: str) -> dict[str, Any]:
    return {
        "reference": "bf16",
        "targets": {
            n: {"spec": {"kv_cache_dtype": n, "expect_cache_dtype": n, "args": []}}
            for n in ("bf16", *names)
        },
    }


def _manifest(*names: str) -> Manifest:
    return Manifest.from_json(_manifest_json(*names))


def test_each_candidate_is_decided_at_alpha_over_k() -> None:
    """p = 0.03: a loss for one candidate alone (alpha 0.05), not when three share alpha."""
    names = ("fp8", "fp8_e5m2", "int8_per_token_head")
    summary = _summary(
        {"fp8": (400, 2, 2), "fp8_e5m2": (200, 14, 4), "int8_per_token_head": (400, 40, 2)}
    )
    manifest = _manifest(*names)
    alone = decide_candidates(summary, manifest, ["fp8_e5m2"], "fp8_e5m2", {}, Thresholds())
    assert alone["fp8_e5m2"].verdict == "calibrate"
    out = decide_candidates(summary, manifest, list(names), "fp8", {}, Thresholds())
    assert list(out) == list(names)
    assert out["fp8"].verdict == "keep" and out["fp8"].headline.startswith("KEEP FP8 at scale 1.0")
    assert out["fp8_e5m2"].verdict != "calibrate"  # p = 0.03 > 0.05 / 3
    # a per-token-head format has no scales to calibrate: its repeatable loss rejects it
    int8 = out["int8_per_token_head"]
    assert int8.verdict == "reject" and int8.exit_code == 12
    assert int8.headline.startswith("REJECT int8_per_token_head for this path")
    assert "no calibration applies" in int8.reasons[0]
    for v in out.values():
        (note,) = [e for e in v.evidence if e["kind"] == "multiplicity"]
        assert "3 candidates" in note["text"] and "alpha 0.0167" in note["text"]


def test_another_format_keeps_its_own_name() -> None:
    summary = _summary({"fp8_e5m2": (400, 2, 2)})
    out = decide_candidates(
        summary, _manifest("fp8_e5m2"), ["fp8_e5m2"], "fp8_e5m2", {}, Thresholds()
    )
    v = out["fp8_e5m2"]
    assert v.verdict == "keep" and v.headline.startswith("KEEP fp8_e5m2 at scale 1.0: matches")
    assert not [e for e in v.evidence if e["kind"] == "multiplicity"]  # one candidate


def test_an_emulated_format_is_named_as_emulated(tmp_path: Any) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 4, "hidden_size": 256}')
    name = "nvfp4-emulated"
    raw = _manifest_json(name)
    raw["targets"][name]["spec"]["model"] = str(model)
    manifest = Manifest.from_json(raw)
    summary = _summary({name: (400, 2, 2)})
    v = decide_candidates(summary, manifest, [name], name, {}, Thresholds())[name]
    assert v.verdict == "emulated" and v.headline.startswith("NO VERDICT ON EMULATED nvfp4")
    assert "emulates nvfp4" in v.reasons[0]
    (cap,) = [e for e in v.evidence if e["kind"] == "systems" and "implied" in e["text"]]
    assert "3.56x BF16's tokens" in cap["text"] and "head size 64" in cap["text"]
    assert format_of(name, manifest) == ("nvfp4", True)
    assert format_of("fp8_e5m2-b", Manifest.from_json({})) == ("fp8_e5m2", False)


def test_fp8_verdicts_are_left_as_the_rule_words_them() -> None:
    v = verdict_record("calibrate", ["repeatable loss"], [])
    assert in_its_words(v, "fp8", _manifest("fp8")) is v
    assert in_its_words(v, "bf16-b", Manifest.from_json({})) is v


def test_the_candidates_are_every_target_but_the_reference_calibrated_and_control(
    tmp_path: Any,
) -> None:

    from replay.pipeline.analyse import candidates_of
    from tests.support import analysis_run

    a = analysis_run.analysis(tmp_path / "run")
    assert candidates_of(a.run()) == ["fp8"]  # fp8-cal: the calibrated arm, bf16-control: A/A
    t = a.manifest.targets
    more = {**t, "int8_per_token_head": t["fp8"], "fp8_e5m2": t["fp8"]}
    given = {"targets": "bf16,int8_per_token_head,fp8,fp8_e5m2"}
    b = a.with_manifest(targets=more, cli_options=given)
    assert candidates_of(b.run()) == ["fp8", "int8_per_token_head", "fp8_e5m2"]


def test_the_layers_arm_is_no_candidate_of_its_own(tmp_path: Any) -> None:
    """``--skip-layers fp8-skip=...``: the primary candidate with some layers in BF16, decided
    as the primary's layers arm, not at alpha / 2 beside it."""
    from dataclasses import replace

    from replay.pipeline.analyse import candidates_of
    from tests.support import analysis_run

    a = analysis_run.analysis(tmp_path / "run")
    assert a.manifest.roles is not None
    roles = replace(a.manifest.roles, layers="fp8-skip")
    targets = {**a.manifest.targets, "fp8-skip": a.manifest.targets["fp8"]}
    b = a.with_manifest(roles=roles, targets=targets, cli_options={"targets": "bf16,fp8,fp8-skip"})
    assert candidates_of(b.run()) == ["fp8"]
