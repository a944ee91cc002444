"""OpenAI-style request logs: what a gateway or proxy records of each chat completion.

One JSON object a line, e.g.::

    {"id": "req-7", "timestamp": "2025-01-31T12:00:00.250Z",
     "request": {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                 "tools": [...], "max_tokens": 256, "temperature": 0},
     "response": {"object": "chat.completion", "choices": [{"message": {"role": "assistant",
                  "content": null, "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}}]}}]}}

Top-level keys (any other is refused, by name):

- ``timestamp`` or ``t`` (one of them, required): an ISO-8601 date-time string (what
  ``datetime.fromisoformat`` reads: ``2025-01-31T12:00:00.250Z``, ``...+02:00``; without a zone
  it is UTC) or POSIX seconds (a number; one past 1e11 looks like milliseconds and is refused).
  The arrival offset is the time since the first record's; a record earlier than that is a bad
  row (sort the log by time first).
- ``request`` or ``body`` (one of them, required): the ``/v1/chat/completions`` request body.
- ``id`` (optional): a string or an integer; without it the id is ``openai-LINE``.
- ``response`` (optional): the logged ``chat.completion``. Its ``choices[0].message`` becomes
  ``meta["reference"] = {"content": TEXT_OR_NULL, "tool_calls": [...]}``, the answer production
  gave (kept for grading against it). A response that is an error (``{"error": ...}``, no
  choices) marks a request that failed: it is counted as ``failed`` and not replayed.
- ``meta`` (optional object): kept as ``meta["log"]``.
- ``session`` (optional string or integer): the conversation the request belongs to; its turns
  are replayed in order (``replay.traces.sessions``), each request carrying its history as logged.

Body keys (any other is refused, by name; a key logged as null counts as absent):
``messages`` (required), ``tools`` and ``tool_choice`` become the request's own;
``max_completion_tokens`` or ``max_tokens`` its ``max_tokens`` (absent: trace v1's default,
128); the sampling and format parameters in ``SENT_AS_LOGGED`` go to ``params`` and are sent
as logged (a logged temperature replaces the replay's deterministic default). ``model`` goes to
``meta["model"]`` (the replay sends its targets' model); ``stream``, ``stream_options`` and
``user`` are not kept (the replay always streams, to time each token; an end user's id is not
needed to replay); ``n`` must be 1.
The length policy does not apply: the prompts are text.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from replay.core.errors import TraceError
from replay.core.ids import id_problem
from replay.traces.importers.lengths import LengthPolicy
from replay.traces.importers.trace_rows import (
    Records,
    as_trace_error,
    iso_seconds,
    json_objects,
    refuse_unknown,
)
from replay.traces.trace import Request, Skip, first_error

TOP_KEYS = ("id", "timestamp", "t", "request", "body", "response", "meta", "session")
SENT_AS_LOGGED = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "parallel_tool_calls",
    "reasoning_effort",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
)
NOT_KEPT = ("stream", "stream_options", "user")
BODY_KEYS = (
    "messages",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "model",
    "n",
    *SENT_AS_LOGGED,
    *NOT_KEPT,
)
# A POSIX time in seconds past this is the year 5138: the log counts milliseconds.
MAX_EPOCH_S = 1e11
FAILED = Skip("failed")


def import_openai_log(path: Path, policy: LengthPolicy) -> Records:
    """OpenAI-style request logs (see the module docstring); ``policy`` does not apply."""
    src = str(path)
    first: float | None = None
    for lineno, obj in json_objects(path, "a request-log line"):
        if isinstance(obj, TraceError):
            yield lineno, obj
            continue
        try:
            refuse_unknown(obj, TOP_KEYS, "request-log")
            key = "timestamp" if "timestamp" in obj else "t"
            when = log_time(_one_of(obj, "timestamp", "t"), key)
            first = when if first is None else first
            if when < first:
                raise ValueError(
                    f"{key}: {first - when:.3f} s before the first record's; sort the log by time"
                )
            reference = reference_answer(obj["response"]) if "response" in obj else None
            request = _request(obj, lineno, when - first, reference)  # checked even if failed
            yield lineno, FAILED if isinstance(reference, Skip) else request
        except (ValueError, ValidationError) as exc:
            yield lineno, as_trace_error(src, lineno, exc)


def _one_of(obj: dict[str, Any], a: str, b: str) -> Any:
    if a in obj and b in obj:
        raise ValueError(f"{b}: give one of '{a}' and '{b}', not both")
    if a not in obj and b not in obj:
        raise ValueError(f"{a}: required (or '{b}')")
    return obj[a] if a in obj else obj[b]


def log_time(value: Any, key: str) -> float:
    """POSIX seconds of an ISO-8601 date-time string (no zone: UTC) or a number of seconds."""
    if isinstance(value, str):
        return iso_seconds(value, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key}: must be an ISO-8601 date-time or POSIX seconds, got {value!r}")
    if value < 0:
        raise ValueError(f"{key}: must be seconds >= 0, got {value!r}")
    if value > MAX_EPOCH_S:
        raise ValueError(f"{key}: {value!r} looks like milliseconds; give seconds")
    return float(value)


def _request(
    obj: dict[str, Any], lineno: int, t: float, reference: dict[str, Any] | Skip | None
) -> Request:
    where = "request" if "request" in obj else "body"
    body = _one_of(obj, "request", "body")
    if not isinstance(body, dict):
        raise ValueError(f"{where}: must be a chat/completions request body (an object)")
    body = {k: v for k, v in body.items() if v is not None}  # a logged null: not given
    refuse_unknown(body, BODY_KEYS, "chat/completions request")
    rid = obj.get("id", f"openai-{lineno}")
    if isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"id: must be a non-empty string or an integer, got {rid!r}")
    if (why := id_problem(rid)) is not None:  # a top-level field, not the body's
        raise ValueError(f"id: {why}")
    meta: dict[str, Any] = {"source": "openai-log", "line": lineno}
    if "model" in body:
        meta["model"] = body["model"]
    if isinstance(reference, dict):
        meta["reference"] = reference
    if "meta" in obj:
        if not isinstance(obj["meta"], dict):
            raise ValueError("meta: must be an object")
        meta["log"] = obj["meta"]
    session = obj.get("session")
    if session is not None and (not isinstance(session, str | int) or isinstance(session, bool)):
        raise ValueError(f"session: must be a string or an integer, got {session!r}")
    try:
        return Request(
            id=rid,
            t=t,
            api="chat",
            session=None if session is None else str(session),
            meta=meta,
            **_chat_fields(body, where),
        )
    except ValidationError as exc:
        field, reason = first_error(exc)
        raise ValueError(f"{where}.{field}: {reason}") from None


def _chat_fields(body: dict[str, Any], where: str) -> dict[str, Any]:
    """The Request fields a chat/completions body gives."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}.messages: a chat request needs a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}.messages.{i}: a message must be an object")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(x, dict) for x in tools)
    ):
        raise ValueError(f"{where}.tools: must be a list of tool objects")
    if body.get("n", 1) != 1:
        raise ValueError(f"{where}.n: only one answer a request (n = 1) can be replayed")
    limits = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if k in body}
    if len(set(map(repr, limits.values()))) > 1:
        raise ValueError(f"{where}.max_tokens: differs from max_completion_tokens")
    fields: dict[str, Any] = {
        "messages": tuple(messages),
        "tools": tuple(tools) if tools else None,
        "tool_choice": body.get("tool_choice"),
        "params": {k: body[k] for k in SENT_AS_LOGGED if k in body},
    }
    if limits:
        fields["max_tokens"] = next(iter(limits.values()))
    return fields


def reference_answer(response: Any) -> dict[str, Any] | Skip:
    """``{"content", "tool_calls"}`` of a logged chat.completion's first choice, or ``FAILED``
    for a logged error."""
    if not isinstance(response, dict):
        raise ValueError("response: must be a chat.completion object")
    if "error" in response and "choices" not in response:
        return FAILED
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError("response.choices: must be a non-empty list")
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        raise ValueError("response.choices.0.message: must be an object")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError("response.choices.0.message.content: must be text or null")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError("response.choices.0.message.tool_calls: must be a list")
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise ValueError(
                f"response.choices.0.message.tool_calls.{i}.function: needs a name and "
                "arguments (a JSON string)"
            )
    return {"content": content, "tool_calls": calls}
