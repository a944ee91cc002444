"""``ResultTable``: a run's results as columns, the form the analysis holds them in.

A ``Result`` is a Python object of some forty fields, each number a float object and each
chunk time a list item: about a kilobyte a result, a gigabyte at a million. Here each field is
one array (8 bytes a number, NaN where there is none; labels as small codes; every chunk of
every result, and every answer's text, in one flat array with offsets), and what few results
carry (an error's message, tool calls, content parts of other types, a session) kept by row.
A table is what ``lean`` leaves of a result: no prompt token ids, log-probabilities or
reasoning text, which the analysis never reads.

It is a ``Sequence[Result]``: ``table[i]`` builds row i's ``Result`` when code wants one
(grading reads an answer at a time), so what reads results one by one reads a table the same
way. What reads them all (the summary's table, the systems comparison) reads the columns.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any, NamedTuple, overload

import numpy as np
import numpy.typing as npt

from replay.core.records import Result, ToolCall

# Read as they are written (``Result.to_json``) but not stored: derived from the stamps.
_DERIVED = frozenset({"ttft", "e2e", "queue_delay", "time_to_answer"})
# What a table does not hold (``lean``): read and dropped.
_DROPPED = frozenset({"prompt_ids", "output_logprobs", "reasoning_text"})
_REQUIRED = ("request_id", "target", "phase", "bucket", "scheduled")
LABELS = ("target", "phase", "bucket", "status", "error_kind", "finish_reason")
TIMES = ("scheduled", "sent", "first_token", "done", "first_answer_token")
# Integers a result may lack (None), held as floats: exact below 2**53.
OPTIONAL_INTS = ("http_status", "prompt_tokens", "turn", "reused_prefix_tokens")
COUNTS = ("output_tokens", "reasoning_tokens", "shared_stamps", "after_finish")
FLAGS = (
    "tokens_estimated",
    "chunk_tokens_estimated",
    "output_truncated",
    "reasoning_tokens_estimated",
    "no_done",
)
_SPARSE = ("error", "tool_calls", "other_content_parts", "session")
_KNOWN = frozenset(f.name for f in fields(Result))
_READ = _KNOWN | _DERIVED  # the fields a row may have
_DEFAULTS: dict[str, Any] = {"status": "ok", "output_tokens": 0, "reasoning_tokens": 0}
_NAN = float("nan")


class _Labels:
    """One label column: a code a row, each distinct value once (-1: None), numbered in the
    order the values first appear (``ResultTable.add_row`` fills it)."""

    def __init__(self) -> None:
        self.codes = array("i")
        self.values: list[str] = []
        self._code: dict[str, int] = {}


class AnswerRow(NamedTuple):
    """What grading reads of one result (``ResultTable.answer_row``): made for each result as
    grading reaches it, at a third of the cost of its whole ``Result``."""

    request_id: str
    target: str
    phase: str
    bucket: str
    status: str
    error_kind: str | None
    error: str | None
    output_text: str
    tool_calls: Sequence[ToolCall]
    output_ids: list[int]
    reasoning_tokens: int
    first_answer_token: float | None
    finish_reason: str | None


class ResultTable(Sequence[Result]):
    """The results of a run, as columns (see the module's docstring). Build one with
    ``from_rows`` (JSON rows, as results.jsonl holds them) or ``of`` (``Result`` objects)."""

    def __init__(self) -> None:
        self._labels = {name: _Labels() for name in (*LABELS, "request_id")}
        self._floats = {name: array("d") for name in (*TIMES, *OPTIONAL_INTS)}
        self._counts = {name: array("q") for name in COUNTS}
        self._flags = {name: bytearray() for name in FLAGS}
        self._chunk_times, self._chunk_tokens, self._output_ids = array("d"), array("q"), array("q")
        self._times_at, self._tokens_at, self._ids_at = (
            array("q", [0]),
            array("q", [0]),
            array("q", [0]),
        )
        # Every answer's text, UTF-8 one after another (a str object a row would cost about
        # fifty bytes more each); surrogates a decoder let through survive the trip.
        self._text, self._text_at = bytearray(), array("q", [0])
        self._sparse: dict[str, dict[int, Any]] = {name: {} for name in _SPARSE}
        self._n = 0

    # -- building -------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]]) -> ResultTable:
        """A table of results.jsonl's rows; a row that is not a result raises ``KeyError``,
        ``TypeError`` or ``ValueError`` naming what is wrong, as ``Result.from_json`` does."""
        table = cls()
        for row in rows:
            table.add_row(row)
        return table

    @classmethod
    def of(cls, results: Iterable[Result]) -> ResultTable:
        """A table of ``Result`` objects (a table is returned as it is)."""
        if isinstance(results, ResultTable):
            return results
        table = cls()
        for r in results:
            table.add_row(_as_row(r))
        return table

    def add_row(self, row: Mapping[str, Any]) -> None:
        if not row.keys() <= _READ:
            raise TypeError(f"unexpected fields {sorted(row.keys() - _READ)}")
        get = row.get
        if any(get(k) is None for k in _REQUIRED):
            raise TypeError(f"missing {[k for k in _REQUIRED if get(k) is None]}")
        # Loops written out, not calls a column: a million rows make each call count.
        for name, column in self._labels.items():
            value = get(name, _DEFAULTS.get(name))
            if value is None:
                column.codes.append(-1)
                continue
            if not isinstance(value, str):
                raise TypeError(f"{name} is {type(value).__name__}, not text")
            code = column._code.get(value)
            if code is None:
                code = column._code[value] = len(column.values)
                column.values.append(value)
            column.codes.append(code)
        for name, floats in self._floats.items():
            x = get(name)
            floats.append(_NAN if x is None else float(x))
        for name, ints in self._counts.items():
            ints.append(int(get(name, 0)))
        for name, flags in self._flags.items():
            flags.append(bool(get(name, False)))
        times, tokens = get("chunk_times") or (), get("chunk_tokens") or ()
        if len(tokens) < len(times):
            raise ValueError(f"{len(times)} chunk times but {len(tokens)} chunk token counts")
        self._chunk_times.extend(map(float, times))
        self._chunk_tokens.extend(map(int, tokens))
        self._output_ids.extend(map(int, get("output_ids") or ()))
        self._times_at.append(len(self._chunk_times))
        self._tokens_at.append(len(self._chunk_tokens))
        self._ids_at.append(len(self._output_ids))
        self._text += (get("output_text") or "").encode("utf-8", "surrogatepass")
        self._text_at.append(len(self._text))
        i = self._n
        for name in _SPARSE:
            value = get(name)
            if value is None or (name in ("tool_calls", "other_content_parts") and not value):
                continue
            self._sparse[name][i] = _tool_calls(value) if name == "tool_calls" else value
        self._n += 1

    # -- the Sequence[Result] it is -------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Result: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Result]: ...
    def __getitem__(self, i: int | slice) -> Result | Sequence[Result]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._result(i)

    def __iter__(self) -> Iterator[Result]:
        return map(self._result, range(self._n))

    def _result(self, i: int) -> Result:
        row: dict[str, Any] = {name: self._label(name, i) for name in self._labels}
        for name, floats in self._floats.items():
            x = floats[i]
            row[name] = None if x != x else (int(x) if name in OPTIONAL_INTS else x)
        for name, counts in self._counts.items():
            row[name] = counts[i]
        for name, flags in self._flags.items():
            row[name] = bool(flags[i])
        sparse = self._sparse
        return Result(
            **row,
            chunk_times=self._chunk_times[self._times_at[i] : self._times_at[i + 1]].tolist(),
            chunk_tokens=self._chunk_tokens[self._tokens_at[i] : self._tokens_at[i + 1]].tolist(),
            output_ids=self._output_ids[self._ids_at[i] : self._ids_at[i + 1]].tolist(),
            output_text=self.output_text(i),
            error=sparse["error"].get(i),
            tool_calls=list(sparse["tool_calls"].get(i, ())),
            other_content_parts=dict(sparse["other_content_parts"].get(i, {})),
            session=sparse["session"].get(i),
        )

    def answer_row(self, i: int) -> AnswerRow:
        """Row i as grading reads it."""
        label = self._label
        answer_at = self._floats["first_answer_token"][i]
        return AnswerRow(
            self._required("request_id", i),
            self._required("target", i),
            self._required("phase", i),
            self._required("bucket", i),
            self._required("status", i),
            label("error_kind", i),
            self._sparse["error"].get(i),
            self.output_text(i),
            self._sparse["tool_calls"].get(i, ()),
            self._output_ids[self._ids_at[i] : self._ids_at[i + 1]].tolist(),
            self._counts["reasoning_tokens"][i],
            None if answer_at != answer_at else answer_at,
            label("finish_reason", i),
        )

    def output_text(self, i: int) -> str:
        """Row i's answer."""
        return self._text[self._text_at[i] : self._text_at[i + 1]].decode("utf-8", "surrogatepass")

    def _required(self, name: str, i: int) -> str:
        """Row i's label of a column every row has (``_REQUIRED``, and the status)."""
        column = self._labels[name]
        return column.values[column.codes[i]]

    def _label(self, name: str, i: int) -> str | None:
        column = self._labels[name]
        code = column.codes[i]
        return None if code < 0 else column.values[code]

    # -- columns --------------------------------------------------------------------------------
    def codes(self, name: str) -> npt.NDArray[np.int32]:
        """A label column's codes (``LABELS`` or ``request_id``; -1: None)."""
        return np.frombuffer(self._labels[name].codes, dtype=np.int32)

    def values(self, name: str) -> list[str]:
        """A label column's distinct values: code k is ``values(name)[k]``."""
        return self._labels[name].values

    def labels(self, name: str, none: str | None = None) -> npt.NDArray[np.object_]:
        """A label column as text, a row each (the same string objects); None as ``none``."""
        table = np.array([*self._labels[name].values, none], dtype=object)
        return table[self.codes(name)]  # code -1 picks ``none``, the last

    def code_of(self, name: str, value: str) -> int:
        """The code of ``value`` in a label column; -2 (no row's) when no row has it."""
        return self._labels[name]._code.get(value, -2)

    def floats(self, name: str) -> npt.NDArray[np.float64]:
        """A time (``TIMES``) or an optional integer (``OPTIONAL_INTS``); NaN: None."""
        return np.frombuffer(self._floats[name], dtype=np.float64)

    def counts(self, name: str) -> npt.NDArray[np.int64]:
        return np.frombuffer(self._counts[name], dtype=np.int64)

    def flags(self, name: str) -> npt.NDArray[np.bool_]:
        return np.frombuffer(self._flags[name], dtype=np.bool_)

    def chunks(
        self,
    ) -> tuple[
        npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
    ]:
        """Every result's chunk times and token counts, flat, with where each row's start
        (``times_at[i]``, ``tokens_at[i]``; one more entry than rows)."""
        return (
            np.frombuffer(self._chunk_times, dtype=np.float64),
            np.frombuffer(self._chunk_tokens, dtype=np.int64),
            np.frombuffer(self._times_at, dtype=np.int64),
            np.frombuffer(self._tokens_at, dtype=np.int64),
        )

    def request_ids(self) -> set[str]:
        return set(self._labels["request_id"].values)


def _tool_calls(calls: Sequence[Any]) -> list[ToolCall]:
    return [c if isinstance(c, ToolCall) else ToolCall(**c) for c in calls]


def _as_row(r: Result) -> dict[str, Any]:
    """A result's fields, as ``add_row`` takes them (no copy of its lists)."""
    return {f: getattr(r, f) for f in _KNOWN if f not in _DROPPED}


def phase_spans(
    t: ResultTable, known: Iterable[str], target: str | None = None
) -> dict[str, tuple[float, float]]:
    """The span of each phase that a result (``target``'s, or any) names but ``known`` does
    not (a run killed inside it has no window for it): from the earliest of its results'
    schedule, send and end times to the latest. Phases in the order results first name them."""
    phase = t.codes("phase")
    mask = ~np.isin(phase, [t.code_of("phase", p) for p in known])
    if target is not None:
        mask &= t.codes("target") == t.code_of("target", target)
    rows = np.flatnonzero(mask)
    if not rows.size:
        return {}
    stamps = np.stack([t.floats(k)[rows] for k in ("scheduled", "sent", "done")])
    codes, first = np.unique(phase[rows], return_index=True)
    out = {}
    for code in codes[np.argsort(first)]:
        mine = stamps[:, phase[rows] == code]
        out[t.values("phase")[code]] = (float(np.nanmin(mine)), float(np.nanmax(mine)))
    return out


def keyed_rows(t: ResultTable, target: str) -> dict[tuple[str, str], int]:
    """``target``'s rows by (phase, request id); a request answered twice in a phase (a
    looping Locust test): its last row."""
    rows = np.flatnonzero(t.codes("target") == t.code_of("target", target))
    phases, ids = t.values("phase"), t.values("request_id")
    keys = zip(t.codes("phase")[rows], t.codes("request_id")[rows], strict=True)
    return {(phases[p], ids[r]): int(i) for (p, r), i in zip(keys, rows, strict=True)}
