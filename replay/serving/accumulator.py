"""Folding a streamed answer into its Result: text, tool calls, token arrivals and usage.

Tokens, by how the server reports usage (a chunk with no content and no tool call is never a
token arrival; its tokens go to the next content chunk, or only to ``output_tokens`` when
none follows, as vLLM's EOS does):

* on every chunk (``continuous_usage_stats``, what we ask for): a content chunk carries the
  growth of ``completion_tokens`` since the tokens already given to earlier arrivals, so a
  chunk of several tokens spreads its gap over them;
* only at the end (``include_usage`` alone, as many gateways send it): every content chunk is
  one arrival of one token, so ITL is the gap between content chunks, ``output_tokens`` is
  the final usage and ``chunk_tokens_estimated`` says the split was not reported;
* not at all: the same per chunk, and ``output_tokens`` counts content chunks
  (``tokens_estimated``).

What a result stores is capped (``MAX_ANSWER_CHARS``, ``MAX_STORED_TOKENS``,
``MAX_TOOL_CALLS``, flagged ``output_truncated``) so that an endless answer neither fills
memory nor goes whole into ``results.jsonl``; timing and token counts still run to the end.
A stream that breaks these rules (impossible usage, no content, cut short) is the server's
``ProtocolError``.

A count is bounded before anything is sized by it: ``completion_tokens`` may not pass the
request's ``max_tokens`` (vLLM stops there, counting every token it generates, reasoning and
EOS included), checked as each count arrives, before its tokens are given to an arrival. Each
arrival's tokens become that many ITL gaps in the analysis and in ``Result.itl``, so a count
the request did not allow (millions a chunk) would size their memory by the server's word,
and inflate the throughput beside them: it is the server's protocol error instead, and the
memory the analysis needs is bounded by what the trace asked for, whatever a server claims.

An event that says it is an error (vLLM's and OpenAI's ``{"error": ...}``, older vLLM's
``{"object": "error", ...}``, ``{"type": "error", ...}``: ``error_answers.stream_error``) or
a ``finish_reason`` of ``error`` is the server's error (``server_error``) with its message,
never a part of the answer, and nothing after it is read. A choice that carries ``message``,
a whole answer's shape, where a chunk's ``delta`` belongs is a protocol error, not an empty
answer: whether it holds a piece or the whole answer so far cannot be told.

Reasoning (``delta.reasoning_content``, or ``delta.reasoning`` as vLLM names it since 0.10)
is kept apart from the answer: its text in ``reasoning_text``, never in ``output_text``. Its
tokens are arrivals like the answer's (``first_token`` is the first token of either kind, ITL
covers both, ``output_tokens`` counts both); ``first_answer_token`` is the first arrival that
carried answer text or a tool call. ``reasoning_tokens`` is the server's own count
(``usage.completion_tokens_details.reasoning_tokens``) where it gives one, else the tokens of
the arrivals that carried reasoning and no answer (``reasoning_tokens_estimated``).

Events that came in one read share its stamp (the kernel's receive time of the read's last
segment, kernel_stamps.py): they are one arrival, their tokens summed, so the read's gap is
spread over all of them rather than giving each a gap of 0 ms; ``shared_stamps`` counts the
content chunks folded so. ``delta.content`` may be a list of content parts: text parts are the
answer, other parts are counted by type (``other_content_parts``). One choice a request: a
choice with another index is a protocol error (two answers must never be merged into one).

A stream that ends after its choice's ``finish_reason`` but without ``data: [DONE]`` (in
good order, or by a reset: ``client.py``) is a complete answer, kept (``no_done`` says so):
some servers and gateways never send it, and the finish reason is the model's own word that it
stopped. One that ends with neither was cut short: a protocol error. For the same reason a
choice that comes after the finish reason is not read (``after_finish`` counts the chunks that
carried anything); the usage that follows it still is (vLLM's last chunk is usage alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replay.core.records import Result, ToolCall
from replay.core.strict import integer, number, shown
from replay.serving.chunk_fields import (
    carries_answer,
    refuse_message,
    text_field,
    token_id_list,
    usage_count,
)
from replay.serving.error_answers import fail, stream_error
from replay.serving.sse import ProtocolError

# Answer text kept per result (text and tool-call names and arguments together): about 250k
# tokens, past any max_tokens a trace asks for; the rest is counted, not kept.
MAX_ANSWER_CHARS = 1 << 20
# Arrival times and output token ids kept per result (memory and results.jsonl line size).
MAX_STORED_TOKENS = 1 << 18
MAX_TOOL_CALLS = 128
# A token count past this is no count a server made (and past 2**64 none that orjson could
# write to results.jsonl).
_MAX_COUNT = 1 << 40


# What one choice's delta carried (``_choices``): nothing, answer text or a tool call, or
# reasoning alone.
_NOTHING, _ANSWER, _REASONING = 0, 1, 2


class StreamAccumulator:
    """Folds streamed chunks into a Result."""

    __slots__ = (
        "_arrivals",
        "_attributed",
        "_calls",
        "_ended",
        "_estimated",
        "_id_room",
        "_last_t",
        "_max_count",
        "_reasoning",
        "_reasoning_arrived",
        "_reasoning_reported",
        "_reasoning_room",
        "_reported",
        "_room",
        "_stamps_left",
        "_text",
        "_usage_seen",
        "now",
        "r",
    )

    def __init__(
        self,
        result: Result,
        now: Callable[[], float],
        max_chars: int = MAX_ANSWER_CHARS,
        max_tokens: int | None = None,
    ) -> None:
        self.r = result
        self.now = now
        self._max_count = _MAX_COUNT if max_tokens is None else min(max_tokens, _MAX_COUNT)
        self._ended = False  # a finish_reason or the server's error came: the answer is over
        self._usage_seen = False
        self._reported = 0  # the server's last completion_tokens
        self._attributed = 0  # completion_tokens given to arrivals so far (usage per chunk)
        self._arrivals = 0  # content chunks counted as one token each (usage not per chunk)
        self._estimated = False  # an arrival's token count was not reported
        self._room = max_chars  # answer characters that may still be kept
        self._reasoning_room = max_chars  # and reasoning characters, apart
        self._id_room = MAX_STORED_TOKENS
        self._stamps_left = MAX_STORED_TOKENS
        self._last_t = -1.0  # the last arrival's stamp
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._reasoning_reported: int | None = None  # the server's reasoning_tokens, if any
        self._reasoning_arrived = 0  # tokens of arrivals that carried reasoning alone
        self._calls: dict[int, ToolCall] = {}

    @property
    def ended(self) -> bool:
        """Whether the answer is over: its finish reason, or the server's error, came."""
        return self._ended

    def add(self, ev: Any, t: float | None = None) -> None:
        """One event: its usage, its choices' content, and the token arrival it makes.

        Runs once per streamed chunk: lookups are done once and the usual keys checked first
        (bench/: this was the client's largest own cost per token). The choices are folded
        in ``_choices`` and its usage in ``_usage``, the calls made per chunk besides this one.
        """
        # A well-formed JSON event of the wrong shape (a choice that is a number, a token
        # count that is a string) is the server's protocol error, recorded on the request;
        # it must not escape as a TypeError that stops the whole run.
        try:
            r = self.r
            if not isinstance(ev, dict):
                raise ProtocolError(f"SSE event is not a JSON object: {str(ev)[:200]}")
            choices = ev.get("choices")
            if not choices and (said := stream_error(ev)) is not None:
                fail(r, "server_error", said)
                self._ended = True
                return
            if self._ended:
                if r.status != "ok":
                    return  # the server already said what went wrong: nothing after is read
                if carries_answer(choices):
                    r.after_finish += 1
                choices = None  # only the usage after the finish reason is read
            if r.prompt_ids is None and ev.get("prompt_token_ids"):
                r.prompt_ids = token_id_list(ev["prompt_token_ids"], "prompt_token_ids")
            usage = ev.get("usage")
            ct = self._usage(usage) if usage is not None else None
            kind = self._choices(choices) if choices else _NOTHING
            if not kind:
                return  # no content: never a token arrival (its tokens go to the next one)
            if t is None:
                t = self.now()
            if kind == _ANSWER and r.first_answer_token is None:
                r.first_answer_token = t
            if ct is None or self._estimated:
                # Usage only at the end, or none: one token per content chunk, so ITL is the
                # gap between content chunks.
                self._estimated = True
                self._arrivals += 1
                n = 1
            else:
                n = ct - self._attributed
                if n <= 0 and r.first_token is not None:
                    return  # content without a new token belongs to the last arrival
                self._attributed = ct
            if kind == _REASONING:
                self._reasoning_arrived += n
            if r.first_token is None:
                r.first_token = t
            elif t == self._last_t and self._stamps_left < MAX_STORED_TOKENS:
                # Another chunk of the same read: one arrival (its stamp is the read's).
                r.chunk_tokens[-1] += n
                r.shared_stamps += 1
                return
            self._last_t = t
            if self._stamps_left:
                self._stamps_left -= 1
                r.chunk_times.append(t)
                r.chunk_tokens.append(n)
            else:
                r.output_truncated = True
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise ProtocolError(f"malformed SSE event ({exc}): {str(ev)[:200]}") from None

    def _usage(self, usage: Any) -> int | None:
        """A chunk's usage, checked and kept: its ``completion_tokens``, if it gives one."""
        if not isinstance(usage, dict):
            raise ProtocolError(f"usage is not an object: {shown(usage)}")
        r = self.r
        pt = usage.get("prompt_tokens")
        if pt is not None and pt != r.prompt_tokens:  # checked when it changes
            pt = pt if type(pt) is int else usage_count(pt, "prompt_tokens")
            if not 0 <= pt <= _MAX_COUNT:
                raise ProtocolError(f"impossible usage: prompt_tokens {pt}")
            r.prompt_tokens = pt
        got = usage.get("completion_tokens")
        if got is None:
            return None
        ct: int = got if type(got) is int else usage_count(got, "completion_tokens")
        if not self._reported <= ct <= self._max_count:  # below 0 too
            raise self._impossible(ct)
        self._reported = ct
        self._usage_seen = True
        details = usage.get("completion_tokens_details")
        if details:  # vLLM sends it only with a reasoning parser
            self._reasoning_usage(details, ct)
        return ct

    def _impossible(self, ct: int) -> ProtocolError:
        """A completion_tokens that no answer to this request can have."""
        if ct < self._reported:
            after = f" after {self._reported}" if ct >= 0 else ""
            return ProtocolError(f"impossible usage: completion_tokens {ct}{after}")
        if self._max_count < _MAX_COUNT:
            return ProtocolError(
                f"impossible usage: completion_tokens {ct} over the request's max_tokens "
                f"{self._max_count}, where a server stops"
            )
        return ProtocolError(f"impossible usage: completion_tokens {ct} (over {_MAX_COUNT})")

    def _reasoning_usage(self, details: dict[str, Any], ct: int) -> None:
        """The server's count of reasoning tokens so far, from completion_tokens_details."""
        rt = details.get("reasoning_tokens")
        if isinstance(rt, int) and not isinstance(rt, bool):
            if not 0 <= rt <= ct:
                raise ProtocolError(
                    f"impossible usage: reasoning_tokens {rt} of completion_tokens {ct}"
                )
            self._reasoning_reported = rt

    def _choices(self, choices: Any) -> int:
        """Keep the choice's token ids, text, reasoning and tool calls; what it carried."""
        r = self.r
        kind = _NOTHING
        for choice in choices:
            if choice.get("index", 0):
                raise ProtocolError(
                    f"a choice with index {str(choice.get('index'))[:20]}: one answer a request "
                    "was asked for (n = 1), and two are never merged into one"
                )
            ids = choice.get("token_ids")
            if ids:
                # One plain id is what a chunk carries; anything else is read by the rule.
                if not (
                    type(ids) is list and len(ids) == 1 and type(ids[0]) is int and ids[0] >= 0
                ):
                    ids = token_id_list(ids, "token_ids")
                room = self._id_room - len(ids)
                self._id_room = room
                if room >= 0:
                    r.output_ids.extend(ids)
                else:
                    r.output_truncated = True
            if r.prompt_ids is None and choice.get("prompt_token_ids"):
                r.prompt_ids = token_id_list(choice["prompt_token_ids"], "prompt_token_ids")
            logprobs = choice.get("logprobs")
            if logprobs:
                self._logprobs(logprobs)
            delta = choice.get("delta")
            if delta is not None or "delta" in choice:
                delta = delta or {}
                content = delta.get("content")
                if content:
                    if type(content) is not str:
                        content = self._parts(content)
                    if content:
                        room = self._room - len(content)
                        if room >= 0:
                            self._room = room
                            self._text.append(content)
                        else:
                            self._cut(content, self._text)
                        kind = _ANSWER
                for frag in delta.get("tool_calls") or ():
                    if self._tool_fragment(frag):
                        kind = _ANSWER
                # Either name (a server that sends both sends the same text twice); a delta
                # of its answer's text alone (vLLM's usual one) cannot hold any.
                if not (kind and len(delta) == 1):
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if thought:
                        self._keep_reasoning(thought)
                        kind = kind or _REASONING
            else:
                text = choice.get("text")
                if text is None and choice.get("message"):
                    refuse_message(choice["message"])
                if text is not None and type(text) is not str:
                    text = text_field(text, "text")
                if text:
                    room = self._room - len(text)
                    if room >= 0:
                        self._room = room
                        self._text.append(text)
                    else:
                        self._cut(text, self._text)
                    kind = _ANSWER
            finish = choice.get("finish_reason")
            if finish:
                if not isinstance(finish, str):
                    raise TypeError(f"finish_reason {str(finish)[:50]} is not a string")
                r.finish_reason = finish[:100]
                self._ended = True
                if finish == "error":  # vLLM's own word for a generation that failed
                    fail(r, "server_error", "the server ended the answer with finish_reason error")
        return kind

    def _logprobs(self, logprobs: Any) -> None:
        """The log-probabilities of this chunk's tokens: chat's ``content`` entries or
        completions' ``token_logprobs``, kept beside ``output_ids`` (and cut with them)."""
        r = self.r
        if "content" in logprobs:
            values = [entry["logprob"] for entry in logprobs["content"] or ()]
        else:
            values = list(logprobs.get("token_logprobs") or ())
        checked = [number(v) for v in values]
        for v, x in zip(values, checked, strict=True):
            if x is None or x > 0.0:
                raise TypeError(f"token logprob {str(v)[:50]} is not a finite number <= 0")
        if r.output_logprobs is None:
            r.output_logprobs = []
        if len(r.output_logprobs) + len(values) <= MAX_STORED_TOKENS:
            r.output_logprobs.extend(x for x in checked if x is not None)
        else:
            r.output_truncated = True

    def _keep_reasoning(self, text: Any) -> None:
        """Keep a delta's reasoning text, under its own cap."""
        if not isinstance(text, str):
            raise TypeError(f"reasoning {str(text)[:50]} is not a string")
        room = self._reasoning_room - len(text)
        if room >= 0:
            self._reasoning_room = room
            self._reasoning.append(text)
        else:  # its own cap: a long chain of thought never crowds out the answer
            self.r.output_truncated = True
            self._reasoning.append(text[: self._reasoning_room])
            self._reasoning_room = 0

    def _parts(self, parts: Any) -> str:
        """``delta.content`` as a list of content parts: the text of its text parts; any
        other part is counted by its type."""
        if not isinstance(parts, list):
            raise TypeError(
                f"delta.content {str(parts)[:50]} is neither a string nor a list of parts"
            )
        texts = []
        other = self.r.other_content_parts
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            text = part.get("text") if kind in ("text", "output_text") else None
            if isinstance(text, str):
                texts.append(text)
            else:
                name = str(kind)[:50] if isinstance(kind, str) else "(no type)"
                if name in other or len(other) < MAX_TOOL_CALLS:
                    other[name] = other.get(name, 0) + 1
        return "".join(texts)

    def _cut(self, text: str, into: list[str]) -> None:
        """Keep what of ``text`` still fits under the answer cap."""
        part = self._fit(text)
        if part:
            into.append(part)

    def _fit(self, text: str) -> str:
        """What of ``text`` fits under the answer cap; a cut is recorded on the result."""
        room = self._room - len(text)
        if room >= 0:
            self._room = room
            return text
        self.r.output_truncated = True
        room, self._room = self._room, 0
        return text[:room]

    def _tool_fragment(self, frag: dict[str, Any]) -> bool:
        """Join one streamed tool-call fragment; whether it carried anything."""
        idx = integer(frag.get("index", 0))
        if idx is None:
            raise TypeError(f"tool call index {shown(frag.get('index'))} is not an integer")
        call = self._calls.get(idx)
        if call is None:
            if len(self._calls) >= MAX_TOOL_CALLS:
                self.r.output_truncated = True
                return False
            call = self._calls[idx] = ToolCall(index=idx)
        carried = False
        if frag.get("id"):
            call.id = text_field(frag["id"], "tool call id")[:200]
            carried = True
        fn = frag.get("function") or {}
        name = text_field(fn.get("name"), "tool call name")
        args = text_field(fn.get("arguments"), "tool call arguments")
        if name:
            call.name += self._fit(name)
            carried = True
        if args:
            call.arguments += self._fit(args)
            carried = True
        return carried

    def finish(self, *, done: bool = True, head: bytes = b"", at: float | None = None) -> None:
        """Fill in the result (``at``: when the stream's end arrived, else now). ``done``:
        the stream said ``[DONE]``; without it, the message must have ended in good order
        after a finish reason. A stream cut short, without content, or with usage no answer
        can have is the server's protocol error."""
        r = self.r
        r.done = self.now() if at is None else at
        r.output_text = "".join(self._text)
        r.reasoning_text = "".join(self._reasoning)
        r.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        if self._usage_seen:
            r.output_tokens = self._reported
        else:
            r.output_tokens = self._arrivals
            r.tokens_estimated = True
        r.chunk_tokens_estimated = self._estimated
        self._reasoning_count()
        if r.status != "ok":  # the server already said what went wrong
            return
        # An answer of no text is real when the server says it generated tokens and why it
        # stopped (a first token that was EOS); anything else without content is not one.
        empty = r.first_token is None and not (r.finish_reason and self._reported > 0)
        quoted = f"; the body starts: {head[:200]!r}" if empty and head else ""
        if not done:
            if not r.finish_reason or empty:
                raise ProtocolError(
                    "stream ended without [DONE] and without a finish_reason"
                    + (" and without any content" if empty else "")
                    + quoted
                )
            r.no_done = True  # complete by the model's own finish reason
        if empty:
            raise ProtocolError("stream ended without any content (no text, no tool call)" + quoted)
        if self._usage_seen and self._reported == 0 and r.first_token is not None:
            raise ProtocolError("impossible usage: completion_tokens 0 for an answer with content")

    def _reasoning_count(self) -> None:
        """The server's count of reasoning tokens where it gave one that counts what came;
        else the tokens of the arrivals that carried reasoning alone. A count of 0 beside
        reasoning text is no count (vLLM's deepseek_r1 parser counts only inside a
        ``<think>`` the model generated, so a template that opens the block reads 0)."""
        r = self.r
        reported = self._reasoning_reported
        if reported is not None and (reported > 0 or not self._reasoning):
            r.reasoning_tokens = reported
            return
        if self._reasoning:
            r.reasoning_tokens = self._reasoning_arrived
            r.reasoning_tokens_estimated = True
