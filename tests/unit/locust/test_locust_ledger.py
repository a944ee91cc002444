"""The master's ledger of a distributed test (``replay.locust.ledger``), without Locust: every
trace position ends exactly once (answered, lost or unavailable) whatever workers are lost
and when, nothing a worker may have sent goes to another, and the run directory and report
say what each worker sent and lost."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.analysis.run_spec import TraceSpec
from replay.locust.ledger import Account, Ledger, LedgerError
from replay.locust.recorder import RunRecorder, lost_result
from replay.present.report import write_reports
from replay.serving.targets import TargetSpec
from replay.traces.importers import scan
from tests.conftest import ROOT
from tests.support.run_config import bare_spec

SAMPLE = ROOT / "traces" / "sample.jsonl"
OK = {"status": "ok", "sent": 1.0}


def _claim(ledger: Ledger, acc: Account, k: int) -> list[int]:
    seqs = list(range(acc.claimed, acc.claimed + k))
    assert ledger.claim(acc.shard, [[s, acc.position(s), "<256"] for s in seqs])
    return seqs


def _answer(ledger: Ledger, acc: Account, seq: int, answered: Counter[int]) -> None:
    position, _ = acc.open[seq]
    ledger.reported(acc.shard, seq, OK)
    answered[position] += 1


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 40), st.integers(1, 4), st.booleans(), st.data())
def test_every_position_ends_once_whatever_is_lost(
    n: int, shards: int, reassign: bool, data: st.DataObject
) -> None:
    ledger = Ledger(n, [f"node{k}" for k in range(shards)], loop=False)
    answered: Counter[int] = Counter()
    for _ in range(data.draw(st.integers(0, 60))):
        live = ledger.live()
        if not live:
            break
        acc = data.draw(st.sampled_from(live))
        action = data.draw(st.sampled_from(["claim", "claim", "answer", "answer", "lose"]))
        if action == "claim" and acc.claimed < acc.size:
            _claim(ledger, acc, data.draw(st.integers(1, acc.size - acc.claimed)))
        elif action == "answer" and acc.open:
            _answer(ledger, acc, data.draw(st.sampled_from(sorted(acc.open))), answered)
        elif action == "lose":
            takers = [a.shard for a in live if a is not acc]
            plan = ledger.lose(acc.shard, "gone", 1.0, takers, None if reassign else "off")
            assert not plan or reassign
            for shard, positions in plan.items():  # only what the lost one never claimed
                assert not set(positions) & {p for p, _ in acc.lost.open.values()}  # type: ignore[union-attr]
                assert ledger.accounts[shard].adopted[-len(positions) :] == positions
    for acc in ledger.live():  # the live workers send all they hold
        while acc.claimed < acc.size or acc.open:
            if acc.claimed < acc.size:
                _claim(ledger, acc, 1)
            _answer(ledger, acc, min(acc.open), answered)
        ledger.finish(acc.shard, acc.adoptions)
    assert ledger.finished()
    unresolved = Counter(position for position, *_ in ledger.unresolved())
    assert answered + unresolved == Counter(range(n))  # each position exactly once
    books = ledger.to_json()
    lost = sum(b["lost"] + b["unavailable"] for b in books)
    assert sum(b["answered"] for b in books) + lost == n
    assert sum(b["reassigned"] for b in books) == sum(b["adopted"] for b in books)


def test_a_lost_worker_leaves_what_it_took_as_lost_and_the_rest_to_the_others() -> None:
    ledger = Ledger(10, ["a", "b"], loop=False)
    a, b = ledger.accounts
    assert list(a.base) == [0, 2, 4, 6, 8] and list(b.base) == [1, 3, 5, 7, 9]
    _claim(ledger, a, 3)  # positions 0, 2, 4
    assert ledger.claim(0, [[1, 2, "<256"]]) and a.claimed == 3  # sent again: granted as before
    ledger.reported(0, 0, OK)
    plan = ledger.lose(0, "no heartbeat", 2.5, [1])
    assert plan == {1: [6, 8]} and b.adopted == [6, 8] and b.adopted_from == {0: 2}
    assert sorted((p, k) for p, _, k, _ in ledger.unresolved()) == [(2, "lost"), (4, "lost")]
    # It is given up: nothing more is granted to it, whatever it claims.
    assert ledger.claim(0, [[3, 6, "<256"]]) is False
    # It was only cut off: an answer it was granted still counts, and is no longer lost.
    assert ledger.reported(0, 1, OK) is True
    assert [p for p, *_ in ledger.unresolved()] == [4]
    assert ledger.came_back(0, 3.0) and not ledger.came_back(0, 3.5)
    assert not ledger.finished()  # it is back: its last word is awaited
    ledger.finish(0, 0)
    b_seqs = _claim(ledger, b, 7)  # its own five and the two adopted, in that order
    assert [b.open[s][0] for s in b_seqs] == [1, 3, 5, 7, 9, 6, 8]
    ledger.finish(1, 0)  # an older report, sent before the re-assignment reached it
    assert not ledger.finished()
    ledger.finish(1, 1)
    assert ledger.finished()
    row = ledger.to_json()[0]
    assert (row["status"], row["lost"], row["reassigned"], row["answered_after_loss"]) == (
        "lost",
        1,
        2,
        1,
    )
    assert row["lost_at_s"] == 2.5 and row["back_at_s"] == 3.0


def test_without_reassignment_the_unsent_are_unavailable_with_the_reason() -> None:
    ledger = Ledger(6, ["a", "b"], loop=False)
    assert ledger.lose(0, "it quit", 1.0, [1], why_not="re-assignment is off") == {}
    got = list(ledger.unresolved())
    assert [(p, k) for p, _, k, _ in got] == [
        (0, "unavailable"),
        (2, "unavailable"),
        (4, "unavailable"),
    ]
    assert "it quit" in got[0][3] and "re-assignment is off" in got[0][3]
    assert ledger.lose(1, "it quit", 1.0, []) == {}  # the last one: nobody could take them
    assert "no live worker could take them" in list(ledger.unresolved())[-1][3]


def test_a_looping_test_hands_a_lost_workers_whole_list_on() -> None:
    ledger = Ledger(4, ["a", "b"], loop=True)
    a = ledger.accounts[0]
    assert ledger.claim(0, [[0, 0, "x"], [1, 2, "x"], [2, 0, "x"]])  # a second pass
    ledger.reported(0, 0, OK)
    assert ledger.lose(0, "gone", 1.0, [1]) == {1: [0, 2]}
    assert sorted(p for p, *_ in ledger.unresolved()) == [0, 2]  # seqs 1 and 2
    assert a.lost is not None and not a.lost.unavailable


def test_a_claim_out_of_order_is_a_bug() -> None:
    ledger = Ledger(4, ["a"], loop=False)
    with pytest.raises(LedgerError, match="seq 1 after 0"):
        ledger.claim(0, [[1, 1, "x"]])
    with pytest.raises(LedgerError, match="is position 0"):
        ledger.claim(0, [[0, 3, "x"]])


def test_the_run_directory_and_report_say_what_each_worker_sent_and_lost(tmp_path: Path) -> None:
    trace = scan(SAMPLE, "v1", limit=4)
    reqs = list(trace.iter_requests())
    rec = RunRecorder(
        run_dir=tmp_path / "run",
        trace=trace,
        run_spec=replace(
            bare_spec(["t"], ["c2"], checkers=False),
            trace=TraceSpec(path=str(SAMPLE), format="v1", sha256="x", requests=4),
        ),
        spec=TargetSpec(name="t", url="http://x:1"),
        options={},
        driver={"name": "locust"},
        command=[],
    )
    ledger = Ledger(4, ["host_a", "host_b"], loop=False)
    _claim(ledger, ledger.accounts[0], 1)
    ledger.lose(0, "Locust marked it missing", 1.0, [1])
    rec.open_phase("c2", 0.0)
    rows = [
        lost_result(reqs[p], "t", "c2", b or "unknown", 1.0, kind, why).to_json()
        for p, b, kind, why in ledger.unresolved()
    ]
    rec.add_results(rows)
    rec.driver["accounts"] = ledger.to_json()
    rec.close_phase(2.0)
    summary = rec.finish()
    rec.close()
    assert rows[0]["status"] == "cancelled" and rows[0]["bucket"] == "<256"
    phase = summary["targets"]["t"]["phases"]["c2"]["all"]
    assert phase["errors_by_kind"] == {"lost": 1} and phase["ok"] == 0
    assert summary["driver"]["accounts"][0]["reason"] == "Locust marked it missing"
    html, md = write_reports(tmp_path / "run")
    text = Path(md).read_text()
    assert "### Workers" in text and "| 1: host_a | lost |" in text
    assert 'id="workers"' in Path(html).read_text()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["driver"]["accounts"][1]["adopted"] == 1
