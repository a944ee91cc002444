"""One Result as Locust request events: TTFT, inter-token gaps, end-to-end time and tokens,
and the check's verdict, named per bucket so Locust's tables and web UI group them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replay.checkers import Answer, Grader
from replay.core.records import Result
from replay.traces.trace import Request

REQUEST_TYPE = "LLM"
CHECK_TYPE = "CHECK"
DEFAULT_ITL_EVENTS = 256


@dataclass(frozen=True)
class LocustEvent:
    """The arguments of one ``events.request.fire``; ``error`` set means a failure."""

    request_type: str
    name: str
    response_time: float
    response_length: int
    error: str | None = None


def sample_evenly(values: Sequence[float], cap: int) -> list[float]:
    """At most ``cap`` values spread evenly over ``values`` (all when there are fewer), so a
    long answer does not flood the statistics while its gaps keep their distribution."""
    if cap <= 0:
        return []
    n = len(values)
    if n <= cap:
        return list(values)
    return [values[(i * n) // cap] for i in range(cap)]


def locust_events(r: Result, itl_cap: int = DEFAULT_ITL_EVENTS) -> list[LocustEvent]:
    """A Result as Locust request events, one entry name per metric and bucket:

    ``ttft <b>``            time to first token of any kind (reasoning or answer), ms
                            (length: prompt tokens)
    ``answer <b>``          time to first answer token, ms, for an answer that reasoned
                            first (length: its reasoning tokens); otherwise it is the TTFT
    ``itl <b>``             one event per inter-token gap, ms (a chunk of n tokens counts n
                            gaps of a nth of its gap, as ``Result.itl``), at most ``itl_cap``
                            per request, sampled evenly (length: 1 token)
    ``e2e <b>``             whole request, ms (length: output tokens); a failed request is
                            one failure here, with its error kind and message
    ``output_tokens <b>``   the response-time columns hold the output token count
    ``reasoning_tokens <b>`` the same for its reasoning tokens, for an answer that reasoned

    Cancelled requests (the test stopped) are not server outcomes and fire nothing.
    """
    b = r.bucket
    if r.status == "cancelled":
        return []
    if r.status != "ok":
        elapsed = (r.done - r.sent) if r.done is not None and r.sent is not None else 0.0
        reason = f"{r.error_kind}: {(r.error or '').strip()[:300]}"
        return [LocustEvent(REQUEST_TYPE, f"e2e {b}", elapsed * 1000, 0, reason)]
    out: list[LocustEvent] = []
    if r.ttft is not None:
        out.append(LocustEvent(REQUEST_TYPE, f"ttft {b}", r.ttft * 1000, r.prompt_tokens or 0))
    reasoned = r.reasoning_tokens
    if reasoned and r.time_to_answer is not None:
        out.append(LocustEvent(REQUEST_TYPE, f"answer {b}", r.time_to_answer * 1000, reasoned))
    out += [
        LocustEvent(REQUEST_TYPE, f"itl {b}", gap * 1000, 1)
        for gap in sample_evenly(r.itl(), itl_cap)
    ]
    if r.e2e is not None:
        out.append(LocustEvent(REQUEST_TYPE, f"e2e {b}", r.e2e * 1000, r.output_tokens))
    out.append(
        LocustEvent(REQUEST_TYPE, f"output_tokens {b}", float(r.output_tokens), r.output_tokens)
    )
    if reasoned:
        out.append(LocustEvent(REQUEST_TYPE, f"reasoning_tokens {b}", float(reasoned), reasoned))
    return out


def check_event(r: Result, req: Request, grader: Grader) -> LocustEvent | None:
    """``check <b>``: the request's checker on the answer, a failure (with the checker's reason)
    when it does not pass; None for requests without a checker or without an answer. Graded
    under the same bounds as the run's analysis: a hostile answer cannot stall the process."""
    if r.status != "ok" or req.check is None:
        return None
    grade = grader.grade(req.check, Answer(r.output_text, tuple(r.tool_calls)))
    kind = str(req.check.get("type"))
    return LocustEvent(
        CHECK_TYPE,
        f"check {r.bucket}",
        0.0,
        0,
        None if grade.passed else f"{kind}: {grade.reason[:300]}",
    )
