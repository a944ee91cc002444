"""Hot-path records: what one request did, with every timestamp named.

Times are seconds on the run's monotonic clock, measured from the run's start. ``scheduled``
is when the schedule wanted the request sent; ``sent`` when it was; the difference is client
queueing, and latency from ``scheduled`` is reported beside latency from ``sent``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# "skipped": never sent, because the request cannot be served as it is (its prompt does not fit
# the target's context): a property of the request, not a failure of the server.
# Error kind "lost" (status "cancelled"): a distributed load generator died with the request in
# flight; it may have reached the server, its answer never came back (not the server's doing).
Status = Literal["ok", "error", "cancelled", "skipped"]
ErrorKind = Literal[
    "timeout",
    "http",
    "connect",
    "disconnect",
    "protocol",
    "cancelled",
    "server_error",
    "unavailable",
    "too_long",
    "lost",
]


# What ``to_json`` adds to the fields (computed, so not read back).
_DERIVED = ("ttft", "e2e", "queue_delay", "time_to_answer")


@dataclass(slots=True)
class ToolCall:
    """A tool call assembled from streamed ``delta.tool_calls`` fragments (joined by index)."""

    index: int
    id: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class Result:
    """One request against one target. Failures are data: ``status``, ``error_kind``, ``error``."""

    request_id: str
    target: str
    phase: str
    bucket: str
    scheduled: float
    sent: float | None = None
    # The first token of any kind (reasoning or answer): TTFT, as GuideLLM counts it.
    first_token: float | None = None
    done: float | None = None
    status: Status = "ok"
    error_kind: ErrorKind | None = None
    error: str | None = None
    http_status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    # Arrival time of each chunk that carried tokens, and how many tokens it carried.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # The answer (``delta.content``, or the completion's ``text``): what grading reads.
    output_text: str = ""
    # Token ids as the server reports them (``return_token_ids``): the chat-templated prompt
    # and the output, for agreement positions and teacher-forced scoring.
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    # The log-probability of each output token under this target, as it generated it (asked
    # for when teacher-forced scoring is on: a target's own answer scores itself for free).
    output_logprobs: list[float] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    # True when the server reported no usage at all, so ``output_tokens`` counts content chunks.
    tokens_estimated: bool = False
    # True when the server did not report usage on every chunk (only at the end, or never):
    # each content chunk is then one token in ``chunk_tokens``, so ITL is the gap between
    # content chunks; ``output_tokens`` is still the server's final usage when it sent one.
    chunk_tokens_estimated: bool = False
    # True when what is stored was cut at the client's caps (answer text with tool-call names
    # and arguments, arrival times, output token ids): timing and counts still cover it all.
    output_truncated: bool = False
    # Multi-turn sessions: the session, the turn's number (1-based), and how many of its
    # prompt tokens the previous turn's prompt and answer began with (what a prefix cache
    # could serve it; None without token ids).
    session: str | None = None
    turn: int | None = None
    reused_prefix_tokens: int | None = None
    # Reasoning models (``delta.reasoning_content``, or ``delta.reasoning`` in newer vLLM):
    # the chain of thought, kept apart from the answer and never graded, and its tokens.
    # ``output_tokens`` counts them too (the server generated them); ``reasoning_tokens`` is
    # the server's ``completion_tokens_details.reasoning_tokens`` where it reports a count,
    # else the tokens of the arrivals that carried reasoning alone
    # (``reasoning_tokens_estimated``). ``first_answer_token`` is when the first answer token
    # (text or tool call) arrived: the time to first answer token beside TTFT.
    first_answer_token: float | None = None
    reasoning_text: str = ""
    reasoning_tokens: int = 0
    reasoning_tokens_estimated: bool = False
    # Content parts of a type other than text (``delta.content`` as a list), counted by type:
    # recorded, not read as the answer.
    other_content_parts: dict[str, int] = field(default_factory=dict)
    # The stream ended after the choice's finish_reason but without ``data: [DONE]`` (in good
    # order, or by a reset): the answer is complete and kept (some servers and gateways omit it).
    no_done: bool = False
    # Content chunks that came in one read with a later chunk: the kernel stamps a read
    # once (its last segment's arrival), so they are folded into that chunk's arrival, their
    # tokens with its own, and the read's gap is spread over them all (never a 0 ms gap).
    shared_stamps: int = 0
    # Chunks that carried something of an answer after the choice's finish_reason: not read,
    # since the finish reason is the model's word that the answer is complete.
    after_finish: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token is None or self.sent is None:
            return None
        return self.first_token - self.sent

    @property
    def time_to_answer(self) -> float | None:
        """Time to the first answer token (after any reasoning); None without an answer."""
        if self.first_answer_token is None or self.sent is None:
            return None
        return self.first_answer_token - self.sent

    @property
    def e2e(self) -> float | None:
        if self.done is None or self.sent is None:
            return None
        return self.done - self.sent

    @property
    def queue_delay(self) -> float | None:
        return None if self.sent is None else self.sent - self.scheduled

    def itl(self) -> list[float]:
        """Inter-token gaps; a chunk of n tokens spreads its gap over n tokens."""
        out: list[float] = []
        for k in range(1, len(self.chunk_times)):
            n = self.chunk_tokens[k]
            if n <= 0:
                continue
            gap = (self.chunk_times[k] - self.chunk_times[k - 1]) / n
            out.extend([gap] * n)
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft"], d["e2e"], d["queue_delay"] = self.ttft, self.e2e, self.queue_delay
        d["time_to_answer"] = self.time_to_answer
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        d = dict(d)  # the caller's row is left as it is
        for k in _DERIVED:
            d.pop(k, None)
        d["tool_calls"] = [ToolCall(**c) for c in d.get("tool_calls", [])]
        return cls(**d)
