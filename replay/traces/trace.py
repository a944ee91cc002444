"""Trace format v1: one JSON request a line, validated at the boundary.

A bad line is an error that names the file, the line, the field and the reason. With
``on_bad_line="skip"`` it is counted and kept in ``TraceLoad.bad`` (the run directory lists
them); nothing is dropped silently. The format is documented in ``traces/README.md``.

Two ways to hold a trace, one interface (``TraceSource``): ``TraceLoad`` keeps the requests in
a list (tests, small in-process uses); ``importers.StreamedTrace`` keeps only counts and
re-reads the file for each pass, so a trace of any length replays in bounded memory.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from replay.checkers import SpecError, parse_check
from replay.core.errors import TraceError
from replay.core.ids import id_problem
from replay.core.strict import StrictInt, StrictNumber, shown, token_ids

FORMAT_VERSION = 1
TOOLS_AND_PROMPT = ("messages", "prompt", "tools", "tool_choice")
TASKS = ("retrieval", "tool", "code", "json", "chat", "perf")
OnBadLine = Literal["fail", "skip"]


# Request fields a record's ``params`` may not set (it would override what the record says, or
# what the replay controls to measure and compare), and what sets each one instead.
_REPLAY = "the replay sets it"
FIRST_CLASS = {
    **{key: f"the record's own '{key}' sets it" for key in TOOLS_AND_PROMPT},
    "max_tokens": "the record's own 'max_tokens' sets it",
    "max_completion_tokens": "the record's own 'max_tokens' sets it",
    "model": f"{_REPLAY} (the target's served model)",
    "stream": f"{_REPLAY} (every answer streams, to time each token)",
    "stream_options": f"{_REPLAY} (usage on every chunk, to count tokens)",
    "return_token_ids": f"{_REPLAY} (token ids for agreement and scoring)",
    "cache_salt": f"{_REPLAY} (one prefix cache a phase)",
    "n": f"{_REPLAY} (one answer a request, n = 1, is replayed and graded)",
    "best_of": f"{_REPLAY} (one answer a request)",
    "echo": f"{_REPLAY} (the answer is the model's text alone)",
}


class Synth(BaseModel):
    """A length-only request: the prompt is made of deterministic token blocks at run time,
    one block per hash id, so requests sharing hash ids share a prefix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_tokens: StrictInt = Field(gt=0, description="exact prompt length in the target's tokens")
    hash_ids: tuple[StrictInt, ...] = Field(
        default=(), description="ids of prefix blocks, in order"
    )
    block_tokens: StrictInt = Field(default=512, gt=0, description="tokens per hash-id block")


class Request(BaseModel):
    """One trace record (format v1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    t: StrictNumber | None = Field(default=None, ge=0, description="arrival offset, seconds")
    session: str | None = None
    api: Literal["chat", "completions"] = "chat"
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | tuple[StrictInt, ...] | None = None
    synth: Synth | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: StrictInt = Field(default=128, gt=0)
    params: dict[str, Any] = Field(default_factory=dict)
    task: Literal["retrieval", "tool", "code", "json", "chat", "perf"] = "chat"
    check: dict[str, Any] | None = None
    input_tokens: StrictInt | None = Field(default=None, gt=0)
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list | tuple) and token_ids(prompt) is None:
            bad = next((i, v) for i, v in enumerate(prompt) if token_ids([v]) is None)
            raise ValueError(
                f"prompt: token ids are integers >= 0; item {bad[0]} is {shown(bad[1])}"
            )
        return prompt

    @field_validator("params")
    @classmethod
    def _params(cls, params: dict[str, Any]) -> dict[str, Any]:
        for key in params:
            owner = FIRST_CLASS.get(key)
            if owner is not None:
                raise ValueError(f"params.{key}: {owner}; params cannot override it")
        return params

    @field_validator("id")
    @classmethod
    def _id(cls, rid: str) -> str:
        why = id_problem(rid)
        if why is not None:
            raise ValueError(f"id: {why}")
        return rid

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
                raise ValueError(
                    "prompt: a completions request needs exactly one of "
                    "'prompt' (text or token ids) and 'synth'"
                )
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


class TraceSource(Protocol):
    """What a replay needs of a trace: counts, and the requests again on every pass, in trace
    order (each call of ``iter_requests`` starts from the first request)."""

    path: str
    lines: int

    @property
    def count(self) -> int: ...

    @property
    def bad_count(self) -> int: ...

    @property
    def has_synth(self) -> bool: ...

    @property
    def skipped(self) -> dict[str, int]: ...

    def iter_requests(self) -> Iterator[Request]: ...

    def iter_bad(self) -> Iterator[TraceError]: ...


@dataclass
class TraceLoad:
    """What a trace file gave, in memory: the valid requests, and every line that was not."""

    path: str
    requests: list[Request] = field(default_factory=list)
    bad: list[TraceError] = field(default_factory=list)
    lines: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.requests)

    @property
    def bad_count(self) -> int:
        return len(self.bad)

    @property
    def has_synth(self) -> bool:
        return any(r.synth is not None for r in self.requests)

    def iter_requests(self) -> Iterator[Request]:
        return iter(self.requests)

    def iter_bad(self) -> Iterator[TraceError]:
        return iter(self.bad)


def first_error(exc: ValidationError) -> tuple[str, str]:
    """The field and reason of a failed validation's first error, as a trace error names them."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(record)"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
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
        raise TraceError(
            path, lineno, "(line)", f"not valid JSON ({exc}); one object a line"
        ) from None
    if not isinstance(obj, dict):
        raise TraceError(path, lineno, "(line)", "a trace line must be a JSON object")
    if isinstance(obj.get("id"), int) and not isinstance(obj.get("id"), bool):
        obj["id"] = str(obj["id"])
    try:
        return Request.model_validate(obj)
    except ValidationError as exc:
        fld, reason = first_error(exc)
    # Raised outside the handler: an error kept in a bad-line list must not pin the failed
    # validation's frames (and the half-built record in them) through ``__context__``.
    raise TraceError(path, lineno, fld, reason)


UTF8_BOM = b"\xef\xbb\xbf"


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines with 1-based numbers, streamed (a trace may not fit in memory). A
    UTF-8 byte order mark (what Windows editors and Excel write) is not part of line 1."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if lineno == 1:
                raw = raw.removeprefix(UTF8_BOM)
            if raw.strip():
                yield lineno, raw


@dataclass(frozen=True)
class Skip:
    """A row the trace itself marks as not to be replayed (BurstGPT's failed requests, whose
    response has no tokens): neither a request nor a bad line. ``check`` counts it under its
    ``category`` in ``CheckStats.skipped``, so what was left out is reported, never silent."""

    category: str


Parsed = tuple[int, Request | TraceError | Skip]


def parse_line_or_error(raw: bytes, path: str, lineno: int) -> Request | TraceError:
    try:
        return parse_line(raw, path, lineno)
    except TraceError as err:
        return err


class IdIndex:
    """The first line of every request id seen so far, in bounded memory.

    Ids live in a dict until there are ``spill_after`` of them, then move to a temporary
    SQLite file whose page cache is capped: a million-record trace checks for duplicate ids
    without a million strings in memory, and a small one never touches the disk.
    """

    def __init__(self, spill_after: int = 65_536, cache_kib: int = 2048) -> None:
        self.spill_after = spill_after
        self.cache_kib = cache_kib
        self._mem: dict[str, int] | None = {}
        self._db: sqlite3.Connection | None = None
        self._tmp: Any = None

    def first(self, rid: str, lineno: int) -> int | None:
        """Record ``rid`` at ``lineno``; the line it was first seen on if it was seen before."""
        if self._mem is not None:
            prev = self._mem.setdefault(rid, lineno)
            if prev != lineno:
                return prev
            if len(self._mem) > self.spill_after:
                self._spill()
            return None
        assert self._db is not None
        cur = self._db.execute("INSERT OR IGNORE INTO ids VALUES (?, ?)", (rid, lineno))
        if cur.rowcount:
            return None
        row = self._db.execute("SELECT line FROM ids WHERE id = ?", (rid,)).fetchone()
        return int(row[0])

    @property
    def in_memory(self) -> int:
        """How many ids are held in Python objects (the rest are on disk)."""
        return len(self._mem) if self._mem is not None else 0

    def _spill(self) -> None:
        import tempfile

        assert self._mem is not None
        self._tmp = tempfile.TemporaryDirectory(prefix="kvcanary-ids-")
        db = sqlite3.connect(Path(self._tmp.name) / "ids.sqlite", isolation_level=None)
        # A scratch index: no journal, no fsync; a crash loses nothing the trace does not hold.
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.execute(f"PRAGMA cache_size=-{int(self.cache_kib)}")
        db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, line INTEGER) WITHOUT ROWID")
        db.execute("BEGIN")
        db.executemany("INSERT INTO ids VALUES (?, ?)", self._mem.items())
        self._db, self._mem = db, None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def get(self, rid: str) -> int | None:
        """The number recorded for ``rid``, or None if it was never seen (records nothing)."""
        if self._mem is not None:
            return self._mem.get(rid)
        assert self._db is not None
        row = self._db.execute("SELECT line FROM ids WHERE id = ?", (rid,)).fetchone()
        return None if row is None else int(row[0])

    def __enter__(self) -> IdIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class CheckStats:
    """What a streaming check counted: non-blank lines, valid unique requests, and the rows
    the trace marks as not to be replayed, by category (``Skip``)."""

    lines: int = 0
    requests: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


def check(
    path: str,
    items: Iterable[Parsed],
    on_bad_line: OnBadLine,
    bad: Callable[[int, TraceError], None],
    stats: CheckStats | None = None,
) -> Iterator[Request]:
    """Apply the bad-line policy and the unique-id rule to parsed records, streamed.

    Yields the valid requests with unique ids, in trace order; a bad line (or a repeated id)
    raises with ``on_bad_line="fail"``, else goes to ``bad(k, error)`` where ``k`` is its
    position among the records (what a re-read uses to skip it again). A ``Skip`` is counted
    in ``stats.skipped``. Holds no request.
    """
    stats = stats if stats is not None else CheckStats()
    with IdIndex() as seen:
        for k, (lineno, item) in enumerate(items):
            stats.lines += 1
            if isinstance(item, Skip):
                stats.skipped[item.category] = stats.skipped.get(item.category, 0) + 1
                continue
            if isinstance(item, Request):
                first = seen.first(item.id, lineno)
                if first is None:
                    stats.requests += 1
                    yield item
                    continue
                item = TraceError(
                    path, lineno, "id", f"duplicate id '{item.id}' (first on line {first})"
                )
            if on_bad_line == "fail":
                raise item
            bad(k, item)
    if stats.lines == 0:
        raise TraceError(path, 0, "(file)", "the trace is empty")


def collect(path: str, items: Iterable[Parsed], on_bad_line: OnBadLine) -> TraceLoad:
    """Gather parsed records in memory, applying the bad-line policy and the unique-id rule."""
    out = TraceLoad(path)
    stats = CheckStats()
    out.requests.extend(check(path, items, on_bad_line, lambda _k, err: out.bad.append(err), stats))
    out.lines, out.skipped = stats.lines, stats.skipped
    return out
