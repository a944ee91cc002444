"""What the report keeps of results.jsonl and grades.jsonl, read once, line by line: a run of a
million results is never held as a million rows.

``scan_run`` keeps the order in which targets and phases first appear, each group's TTFT and
inter-token gaps (the latency charts, 8 bytes a value) and, per request, the few facts its
flags are decided by (``RequestFacts``). The requests the report shows are read again, whole,
by ``rows_of``.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from replay.analysis.grading.quality import CONTROL_SUFFIX
from replay.analysis.result_table import ResultTable
from replay.analysis.summary import itl_gaps
from replay.present.formatting import num, text
from replay.rundir.files import GRADES, RESULTS

LatencyKey = tuple[str, str, str, str]  # (phase, bucket, target, "ttft" or "itl")


@dataclass(slots=True)
class RequestFacts:
    """One request's flags, folded over its attempts: the phases where the reference passed,
    those where a candidate (not the A/A control) failed, any error, any answer that differs
    from the reference's; ``order`` is where it first appears in the results (-1: never)."""

    order: int = -1
    ref_pass: set[str] = field(default_factory=set)
    cand_fail: set[str] = field(default_factory=set)
    error: bool = False
    differs: bool = False

    def flags(self) -> list[str]:
        out = ["regressed"] if self.ref_pass & self.cand_fail else []
        return out + ["error"] * self.error + ["differs"] * self.differs


@dataclass
class Scan:
    targets: list[object] = field(default_factory=list)  # in order of first appearance
    phases: list[object] = field(default_factory=list)
    latency: dict[LatencyKey, array[float]] = field(default_factory=dict)  # ms
    requests: dict[str, RequestFacts] = field(default_factory=dict)


def scan_run(
    run_dir: Path, reference: str | None, problems: list[str], results: ResultTable | None = None
) -> Scan:
    """One pass over grades.jsonl, then one over results.jsonl; unreadable lines are counted
    in ``problems``. Given ``results`` (the run's results as the analysis just read them), the
    results' part is read off their columns instead: results.jsonl is not read again."""
    scan = Scan()
    for g in json_lines(run_dir / GRADES, problems):
        _fold_grade(scan, g, reference)
    if results is not None:
        _scan_table(scan, results)
        if _cut_short(run_dir / RESULTS):  # as the line by line reading says it
            problems.append(_skipped(RESULTS, 1))
        return scan
    targets: dict[object, None] = {}
    phases: dict[object, None] = {}
    for i, r in enumerate(json_lines(run_dir / RESULTS, problems)):
        targets.setdefault(r.get("target"))
        phases.setdefault(r.get("phase"))
        facts = scan.requests.setdefault(str(r.get("request_id")), RequestFacts())
        if facts.order < 0:
            facts.order = i
        if r.get("status", "ok") != "ok":
            facts.error = True
            continue
        _add_latency(scan.latency, r)
    scan.targets, scan.phases = list(targets), list(phases)
    # A grade whose request no result names is not a request of the report.
    scan.requests = {rid: f for rid, f in scan.requests.items() if f.order >= 0}
    return scan


def _scan_table(scan: Scan, t: ResultTable) -> None:
    """``scan_run``'s reading of results.jsonl, from the results' columns: the same targets
    and phases in the same order, the same facts per request, and the same latencies, in the
    results' order (``test_report_from_the_analysis_columns``)."""
    scan.targets, scan.phases = list(t.values("target")), list(t.values("phase"))
    ids, codes = t.values("request_id"), t.codes("request_id")
    ok = t.codes("status") == t.code_of("status", "ok")
    _, first = np.unique(codes, return_index=True)  # codes are numbered as they first appear
    failed = np.zeros(len(ids), dtype=bool)
    failed[codes[~ok]] = True
    for code, rid in enumerate(ids):
        facts = scan.requests.setdefault(rid, RequestFacts())
        facts.order = int(first[code])
        facts.error = facts.error or bool(failed[code])
    scan.requests = {rid: f for rid, f in scan.requests.items() if f.order >= 0}
    ttft = 1000 * (t.floats("first_token") - t.floats("sent"))
    itl, per_row = itl_gaps(t)
    labels = {name: (t.values(name), t.codes(name)) for name in ("phase", "bucket", "target")}
    group = np.zeros(len(t), dtype=np.int64)
    for values, codes in labels.values():  # one number per (phase, bucket, target)
        group = group * (len(values) + 1) + codes
    group[~ok] = -1  # a failed request has no latency
    gap_group = np.repeat(group, per_row)
    for g in np.unique(group[ok]):
        rows = group == g
        i = int(np.argmax(rows))
        key = tuple(values[codes[i]] for values, codes in labels.values())
        times = ttft[rows]
        if not np.isnan(times).all():
            scan.latency[(*key, "ttft")] = array("d", times[~np.isnan(times)].tobytes())
        scan.latency[(*key, "itl")] = array("d", (1000 * itl[gap_group == g]).tobytes())


def _cut_short(path: Path) -> bool:
    """Whether a file's last line is unfinished (a run killed as it wrote it)."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1) != b"\n"


def _fold_grade(scan: Scan, g: Mapping[str, Any], reference: str | None) -> None:
    facts = scan.requests.setdefault(str(g.get("request_id")), RequestFacts())
    target, phase = text(g.get("target")), text(g.get("phase"))
    passed = _obj(g.get("grade")).get("passed")
    if passed is True and target == reference:
        facts.ref_pass.add(phase)
    elif passed is False and target != reference and not target.endswith(CONTROL_SUFFIX):
        facts.cand_fail.add(phase)
    agreement = _obj(g.get("agreement"))
    if agreement and not agreement.get("exact") and not agreement.get("normalized"):
        facts.differs = True


def _add_latency(latency: dict[LatencyKey, array[float]], r: Mapping[str, Any]) -> None:
    key = (str(r.get("phase")), str(r.get("bucket")), str(r.get("target")))
    ttft, first, sent = (num(r.get(k)) for k in ("ttft", "first_token", "sent"))
    if ttft is None and first is not None and sent is not None:
        ttft = first - sent
    if ttft is not None:
        latency.setdefault((*key, "ttft"), array("d")).append(1000 * ttft)
    latency.setdefault((*key, "itl"), array("d")).extend(1000 * g for g in itl(r))


def itl(r: Mapping[str, Any]) -> list[float]:
    """Inter-token gaps in seconds; a chunk of n tokens spreads its gap over n tokens."""
    times, tokens = _lst(r.get("chunk_times")), _lst(r.get("chunk_tokens"))
    out: list[float] = []
    for k in range(1, min(len(times), len(tokens))):
        a, b, n = num(times[k - 1]), num(times[k]), num(tokens[k])
        if a is not None and b is not None and n is not None and n > 0:
            out.extend([(b - a) / n] * int(n))
    return out


# A line's request id as a JSON writer puts it (unescaped): enough to skip a line unparsed.
_REQUEST_ID = re.compile(rb'"request_id":\s*"([^"\\]*)"')


def rows_of(path: Path, ids: Collection[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file about the requests ``ids``, in the file's order. A
    line is parsed only when its request id, read off the raw line, is one of them (or cannot
    be read so); bad lines are skipped unsaid (the scan counted them)."""
    if not path.exists():
        return []
    wanted = {rid.encode() for rid in ids}
    out = []
    with path.open("rb") as fh:
        for raw in fh:
            found = _REQUEST_ID.search(raw)
            if found is not None and found.group(1) not in wanted:
                continue
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict) and str(row.get("request_id")) in ids:
                out.append(row)
    return out


def json_lines(path: Path, problems: list[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file; bad lines (a run cut short) are counted in
    ``problems``, not fatal."""
    if not path.exists():
        return
    bad = 0
    with path.open("rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                yield row
            else:
                bad += 1
    if bad:
        problems.append(_skipped(path.name, bad))


def _skipped(name: str, bad: int) -> str:
    return f"{name}: {bad} unreadable line(s) skipped"


def _obj(x: object) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _lst(x: object) -> list[Any]:
    return x if isinstance(x, list) else []
