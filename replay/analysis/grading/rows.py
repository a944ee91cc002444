"""Grade rows: one per answer, with its checker's grade, its agreement with the reference's
answer to the same request in the same phase, and, for a request without a check, its derived
grade against that answer (``checkers._derived``).

Grading keeps little of each trace record (``GradingSpec``): its id, task and check, and the
prompt's text only where a derived grade reads it.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from replay.analysis.result_table import AnswerRow, ResultTable, keyed_rows
from replay.checkers import Answer, Grade, Grader, Job, derived_record, normalize
from replay.checkers.grader import GRADES_KEPT
from replay.core.records import Result

# Derived grades read the prompt for facts and code examples; a longer prompt keeps its first
# three quarters and its last quarter of this many characters.
PROMPT_KEEP_CHARS = 131_072


class Gradable(Protocol):
    """What grading needs of a trace record (a ``Request`` is one)."""

    @property
    def id(self) -> str: ...

    @property
    def task(self) -> str: ...

    @property
    def check(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True, slots=True)
class GradingSpec:
    """What grading keeps of a trace record: a long run keeps one per request it sent, so the
    prompt's text is kept only where derived grading reads it (no check), capped at
    ``PROMPT_KEEP_CHARS`` and zlib-compressed (``grading_spec`` builds one)."""

    id: str
    task: str
    check: dict[str, Any] | None
    prompt_z: bytes = b""

    @property
    def prompt_text(self) -> str:
        if not self.prompt_z:
            return ""
        return zlib.decompress(self.prompt_z).decode("utf-8", "surrogatepass")


GRADE_BATCH = 1024  # grades asked of the grader at once: bounds the requests held
# Graders (each its own worker process) grading batches side by side when the caller gives
# none. One: the analysis's own process is the busier one, and on two cores a second worker
# only took from it (at 100k results, 19 s instead of 15, 1.8 s more CPU).
GRADE_WORKERS = 1


def _cap(text: str) -> str:
    if len(text) <= PROMPT_KEEP_CHARS:
        return text
    head = PROMPT_KEEP_CHARS * 3 // 4
    return text[:head] + "\n" + text[len(text) - (PROMPT_KEEP_CHARS - head) :]


def prompt_text(record: Any) -> str:
    """The text a record's prompt shows the model (capped): its messages' contents and the
    calls earlier turns made, or a completions prompt; "" for token ids, synthetic prompts and
    records that carry no prompt."""
    if isinstance(record, GradingSpec):
        return record.prompt_text
    messages = getattr(record, "messages", None)
    parts: list[str] = []
    for m in messages or ():
        if not isinstance(m, Mapping):
            continue
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [
                p["text"]
                for p in content
                if isinstance(p, Mapping) and isinstance(p.get("text"), str)
            ]
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping):
                args = fn.get("arguments", "")
                args = args if isinstance(args, str) else json.dumps(args, default=str)
                parts.append(f"{fn.get('name', '')}({args})")
    prompt = getattr(record, "prompt", None)
    if not messages and isinstance(prompt, str):
        parts.append(prompt)
    return _cap("\n".join(parts))


def grading_spec(record: Gradable) -> GradingSpec:
    """A record's ``GradingSpec``: with its prompt's text only when it has no check."""
    text = prompt_text(record) if record.check is None else ""
    return GradingSpec(
        record.id,
        record.task,
        record.check,
        zlib.compress(text.encode("utf-8", "surrogatepass"), 6) if text else b"",
    )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; None when identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(r: Result | AnswerRow, ref: Result | AnswerRow) -> dict[str, Any]:
    """How an answer agrees with the reference's: exactly, after normalizing, and where their
    tokens first differ (0 for different texts without token ids)."""
    calls = [(c.name, c.arguments) for c in r.tool_calls]
    ref_calls = [(c.name, c.arguments) for c in ref.tool_calls]
    exact = r.output_text == ref.output_text and calls == ref_calls
    return {
        "exact": exact,
        "normalized": exact
        or (normalize(r.output_text) == normalize(ref.output_text) and calls == ref_calls),
        "first_divergence": first_divergence(r.output_ids, ref.output_ids)
        if r.output_ids or ref.output_ids
        else (None if exact else 0),
    }


def grade_rows(
    results: Sequence[Result],
    requests: Mapping[str, Gradable],
    reference: str,
    grader: Grader | None = None,
) -> list[dict[str, Any]]:
    """One row per result: checker grade, agreement with the reference, and, for a request
    without a check, the derived grade against the reference's answer (every target but the
    reference; the A/A control is graded like a candidate)."""
    return list(iter_grade_rows(results, requests, reference, grader))


def iter_grade_rows(
    results: Sequence[Result],
    requests: Mapping[str, Gradable],
    reference: str,
    grader: Grader | None = None,
) -> Iterator[dict[str, Any]]:
    """``grade_rows``' rows, in the results' order, as their grades come (``GRADE_BATCH`` at
    a time): a caller that writes them as they come holds a few batches, not every row.
    The grader grades one batch while the next is built; without a ``grader``,
    ``GRADE_WORKERS`` graders grade alternate batches side by side."""
    if grader is not None:
        yield from _graded(results, requests, reference, [grader])
        return
    # Grades kept: one per result at most. The arms of a run ask the same requests a whole
    # arm apart (results are in the order they completed), so a grader that kept fewer would
    # ask its worker again for most of them.
    kept = max(GRADES_KEPT, len(results))
    with contextlib.ExitStack() as stack:
        graders = [stack.enter_context(Grader(kept=kept)) for _ in range(GRADE_WORKERS)]
        yield from _graded(results, requests, reference, graders)


# A batch: its rows, and the grades they wait on: (row, field, job, why it holds no answer).
_Asked = list[tuple[dict[str, Any], str, Job, str | None]]


def _graded(
    results: Sequence[Result],
    requests: Mapping[str, Gradable],
    reference: str,
    graders: Sequence[Grader],
) -> Iterator[dict[str, Any]]:
    """Batch k is graded by ``graders[k % len(graders)]`` on that grader's own thread (a
    Grader is for one thread at a time), while this one builds the next batch: each grader
    has one batch in hand and at most one waiting. Batches are yielded in order."""
    pending: deque[tuple[list[dict[str, Any]], _Asked, Future[list[Grade]]]] = deque()
    with contextlib.ExitStack() as stack:
        threads = [
            stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="grading"))
            for _ in graders
        ]
        batches = _batches(results, requests, reference)
        for k, (rows, asked) in enumerate(batches):
            jobs = [job for _, _, job, _ in asked]
            grader, thread = graders[k % len(graders)], threads[k % len(graders)]
            pending.append((rows, asked, thread.submit(grader.grade_many, jobs)))
            if len(pending) > len(graders):
                yield from _filled(*pending.popleft())
        while pending:
            yield from _filled(*pending.popleft())


def _filled(
    rows: list[dict[str, Any]], asked: _Asked, grades: Future[list[Grade]]
) -> list[dict[str, Any]]:
    for (row, field, _, unanswered), grade in zip(asked, grades.result(), strict=True):
        if field == "grade":
            row["grade"] = _said(grade.to_json(), unanswered)
        else:
            normalized = row["agreement"]["normalized"]
            row["derived"] = _said(derived_record(grade, normalized), unanswered)
    return rows


def _batches(
    results: Sequence[Result], requests: Mapping[str, Gradable], reference: str
) -> Iterator[tuple[list[dict[str, Any]], _Asked]]:
    """The rows in the results' order, a batch of ``GRADE_BATCH`` grades to ask at a time."""
    table = ResultTable.of(results)
    # The reference's rows, each made a ``Result`` when an answer is compared with it.
    refs = keyed_rows(table, reference)
    rows: list[dict[str, Any]] = []
    asked: _Asked = []
    for i in range(len(table)):
        r = table.answer_row(i)
        req = requests.get(r.request_id)
        row: dict[str, Any] = {
            "target": r.target,
            "phase": r.phase,
            "request_id": r.request_id,
            "bucket": r.bucket,
            "answered": r.status == "ok",
            "task": req.task if req else None,
            "grade": None,
            "agreement": None,
            "derived": None,
        }
        if r.status != "ok":
            row["error"] = f"{r.error_kind}: {r.error}"
        else:
            unanswered = no_answer(r)
            answer = Answer(r.output_text, tuple(r.tool_calls))
            if req is not None and req.check is not None:
                asked.append((row, "grade", Job(answer, spec=req.check), unanswered))
            at = refs.get((r.phase, r.request_id)) if r.target != reference else None
            ref = None if at is None else table.answer_row(at)
            if ref is not None and ref.status == "ok":
                row["agreement"] = agreement(r, ref)
                if req is not None and req.check is None:
                    reference_answer = Answer(ref.output_text, tuple(ref.tool_calls))
                    job = Job(answer, reference=reference_answer, prompt=prompt_text(req))
                    asked.append((row, "derived", job, unanswered))
        rows.append(row)
        if len(asked) >= GRADE_BATCH:
            yield rows, asked
            rows, asked = [], []
    yield rows, asked


def no_answer(r: Result | AnswerRow) -> str | None:
    """Why an ok result that reasoned holds no answer (its reasoning never reached one: cut by
    max_tokens, as a rule); None for any other. Grading reads the answer only, never the
    reasoning, so such a result is graded as the empty answer it is, and says why."""
    if r.reasoning_tokens and r.first_answer_token is None:
        why = f"finish_reason {r.finish_reason}" if r.finish_reason else "no finish_reason"
        return f"no answer: {r.reasoning_tokens} reasoning tokens and then none ({why})"
    return None


def _said(grade: dict[str, Any], unanswered: str | None) -> dict[str, Any]:
    if unanswered is not None:
        grade["reason"] = f"{unanswered}; {grade.get('reason') or ''}".rstrip("; ")
    return grade
