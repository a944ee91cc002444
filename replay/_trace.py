"""Trace format v1: one JSON request a line, validated at the boundary.

A bad line is an error that names the file, the line, the field and the reason. With
``on_bad_line="skip"`` it is counted and kept in ``TraceLoad.bad`` (the run directory lists
them); nothing is dropped silently. The format is documented in ``traces/README.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ._errors import TraceError
from .checkers import SpecError, parse_check

FORMAT_VERSION = 1
TASKS = ("retrieval", "tool", "code", "json", "chat", "perf")
OnBadLine = Literal["fail", "skip"]


class Synth(BaseModel):
    """A length-only request: the prompt is made of deterministic token blocks at run time,
    one block per hash id, so requests sharing hash ids share a prefix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_tokens: int = Field(gt=0, description="exact prompt length in the target's tokens")
    hash_ids: tuple[int, ...] = Field(default=(), description="ids of prefix blocks, in order")
    block_tokens: int = Field(default=512, gt=0, description="tokens per hash-id block")


class Request(BaseModel):
    """One trace record (format v1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    t: float | None = Field(default=None, ge=0, description="arrival offset, seconds")
    session: str | None = None
    api: Literal["chat", "completions"] = "chat"
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | tuple[int, ...] | None = None
    synth: Synth | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int = Field(default=128, gt=0)
    params: dict[str, Any] = Field(default_factory=dict)
    task: Literal["retrieval", "tool", "code", "json", "chat", "perf"] = "chat"
    check: dict[str, Any] | None = None
    input_tokens: int | None = Field(default=None, gt=0)
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _shape(self) -> Request:
        if self.t is not None and not math.isfinite(self.t):
            raise ValueError("t: must be a finite number of seconds")
        if self.api == "chat":
            if not self.messages:
                raise ValueError("messages: a chat request needs a non-empty 'messages' list")
            if self.prompt is not None or self.synth is not None:
                raise ValueError("prompt: a chat request takes 'messages', not 'prompt'/'synth'")
            for i, m in enumerate(self.messages):
                if "role" not in m:
                    raise ValueError(f"messages.{i}.role: every message needs a role")
        else:
            if (self.prompt is None) == (self.synth is None):
                raise ValueError("prompt: a completions request needs exactly one of "
                                 "'prompt' (text or token ids) and 'synth'")
            if self.messages is not None or self.tools is not None:
                raise ValueError("messages: 'messages'/'tools' need api 'chat'")
            if isinstance(self.prompt, str) and not self.prompt:
                raise ValueError("prompt: empty prompt")
            if isinstance(self.prompt, tuple) and not self.prompt:
                raise ValueError("prompt: empty token-id list")
        if self.check is not None:
            # A bad checker spec is found when the trace loads, before any request is sent.
            try:
                parse_check(self.check)
            except SpecError as exc:
                raise ValueError(f"check.{exc.field}: {exc.reason}") from None
        return self

    @property
    def declared_tokens(self) -> int | None:
        """Prompt length known without a tokenizer (synthetic or token-id prompts)."""
        if self.synth is not None:
            return self.synth.input_tokens
        if isinstance(self.prompt, tuple):
            return len(self.prompt)
        return None


@dataclass
class TraceLoad:
    """What a trace file gave: the valid requests, and every line that was not."""

    path: str
    requests: list[Request] = field(default_factory=list)
    bad: list[TraceError] = field(default_factory=list)
    lines: int = 0


def _first_error(exc: ValidationError) -> tuple[str, str]:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(record)"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        head, sep, rest = msg.partition(": ")
        if sep and " " not in head:
            return head, rest
    if err["type"] == "extra_forbidden":
        msg = "unknown field (see traces/README.md for the v1 fields)"
    elif err["type"] == "missing":
        msg = "required field is missing"
    return loc, msg


def parse_line(raw: bytes | str, path: str, lineno: int) -> Request:
    """Validate one line; raise TraceError naming file, line, field and reason."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TraceError(path, lineno, "(line)",
                         f"not valid JSON ({exc}); one object a line") from None
    if not isinstance(obj, dict):
        raise TraceError(path, lineno, "(line)", "a trace line must be a JSON object")
    if isinstance(obj.get("id"), int) and not isinstance(obj.get("id"), bool):
        obj["id"] = str(obj["id"])
    try:
        return Request.model_validate(obj)
    except ValidationError as exc:
        fld, reason = _first_error(exc)
        raise TraceError(path, lineno, fld, reason) from None


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines with 1-based numbers, streamed (a trace may not fit in memory)."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if raw.strip():
                yield lineno, raw


def parse_line_or_error(raw: bytes, path: str, lineno: int) -> Request | TraceError:
    try:
        return parse_line(raw, path, lineno)
    except TraceError as err:
        return err


def collect(path: str, items: Iterable[tuple[int, Request | TraceError]],
            on_bad_line: OnBadLine) -> TraceLoad:
    """Gather parsed records, applying the bad-line policy and the unique-id rule."""
    out = TraceLoad(path)
    seen: dict[str, int] = {}
    for lineno, item in items:
        out.lines += 1
        if isinstance(item, Request):
            first = seen.setdefault(item.id, lineno)
            if first == lineno:
                out.requests.append(item)
                continue
            item = TraceError(path, lineno, "id",
                              f"duplicate id '{item.id}' (first on line {first})")
        if on_bad_line == "fail":
            raise item
        out.bad.append(item)
    if not out.requests and not out.bad:
        raise TraceError(path, 0, "(file)", "the trace is empty")
    return out
