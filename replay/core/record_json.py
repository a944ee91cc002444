"""JSON records: frozen dataclasses whose ``to_json``/``from_json`` follow their annotations.

A record is its field list: ``to_json()`` writes each field under its name, in field order,
and ``from_json(data)`` reads it back, checking each value's type against the annotation and
naming the field (``targets.fp8.phases.c1.all.requests``) in a ``SummaryError`` when it is
wrong. Field types are ``int``, ``float``, ``str``, ``bool``, another record, ``Mapping[str, X]``,
``tuple[X, ...]`` (a JSON list), a fixed ``tuple[float, float]``, ``Mapping[str, Any]`` (JSON
kept as it is), each optionally ``| None``.

Reading is lenient about *missing* keys, because documents written by older versions lack keys
added since: a missing key reads as its field's default where it has a plain one, else as None
(``X | None``), 0, False, "", an empty collection or an empty record. A wrong *type* is an
error; with ``problems=[...]`` (the report, which renders whatever a run directory holds) it is
recorded there instead, and the field reads as if it were missing (an entry of a mapping or a
list is left out). Keys a record does not know (a newer version's) are ignored. Two markers
say how a field is written:

* ``absent_if_none()``: None leaves the key out (no null is ever written there);
* ``Omitted``: three states, for keys that are null in some documents and absent in others.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar, Union

from replay.core.errors import SummaryError

R = TypeVar("R", bound="Record")


class Omitted(enum.Enum):
    """A key left out of the JSON, as opposed to one written as null."""

    KEY = "omitted"


OMITTED = Omitted.KEY
_ABSENT_IF_NONE = "absent_if_none"


def absent_if_none() -> Any:
    """A field whose None is written by leaving its key out."""
    return field(default=None, metadata={_ABSENT_IF_NONE: True})


class _Bad(Exception):
    """A value the lenient reader has recorded as a problem: the caller uses its default."""


@dataclass
class _Reading:
    where: str
    problems: list[str] | None

    def bad(self, path: str, want: str, got: object) -> _Bad:
        shown = repr(got)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        message = f"{self.where}: {path + ': ' if path else ''}expected {want}, got {shown}"
        if self.problems is None:
            raise SummaryError(message)
        self.problems.append(message)
        return _Bad(message)


class Record:
    """Base of the analysis records: JSON out and in, driven by the field annotations."""

    __slots__ = ()
    _hints: ClassVar[dict[type, dict[str, Any]]] = {}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        hints = _hints_of(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is OMITTED or (value is None and f.metadata.get(_ABSENT_IF_NONE)):
                continue
            out[f.name] = _encode(value, hints[f.name])
        return out

    @classmethod
    def from_json(
        cls, data: object, *, where: str = "summary", problems: list[str] | None = None
    ) -> Self:
        """The record of ``data``; ``where`` names the document in error messages. Without
        ``problems`` a wrong type raises ``SummaryError``; with it, each is recorded there."""
        reading = _Reading(where, problems)
        try:
            return cls._read(data, "", reading)
        except _Bad:
            return cls._read({}, "", reading)

    @classmethod
    def _read(cls, data: object, path: str, reading: _Reading) -> Self:
        if not isinstance(data, Mapping):
            raise reading.bad(path, "an object", data)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            hint = _hints_of(cls)[f.name]
            sub = f"{path}.{f.name}" if path else f.name
            if f.name not in data:
                values[f.name] = _absent(f, hint)
                continue
            try:
                values[f.name] = _decode(data[f.name], hint, sub, reading)
            except _Bad:
                values[f.name] = _missing(hint)
        return cls(**values)


def _hints_of(cls: type) -> dict[str, Any]:
    if cls not in Record._hints:
        Record._hints[cls] = typing.get_type_hints(cls)
    return Record._hints[cls]


def _parts(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return Union, typing.get_args(hint)
    return origin, typing.get_args(hint)


def _encode(value: Any, hint: Any) -> Any:
    origin, args = _parts(hint)
    if isinstance(value, Record):
        return value.to_json()
    if origin is Union:
        return value if value is None else _encode(value, _inner(args))
    if origin is Mapping:
        return {k: _encode(v, args[1]) for k, v in value.items()}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return [_encode(v, args[0]) for v in value]  # variadic tuples are JSON lists...
    return value  # ...a fixed pair (an interval, a line) stays a tuple, as it always was


def _inner(args: tuple[Any, ...]) -> Any:
    rest = [a for a in args if a is not types.NoneType and a is not Omitted]
    if len(rest) != 1:
        raise TypeError(f"a record field may be one type, None and Omitted, not {args}")
    return rest[0]


def _absent(f: dataclasses.Field[Any], hint: Any) -> Any:
    """What a key that is not there reads as: the field's default where it has a plain one
    (a setting added since the document was written reads as what it was before), else
    ``_missing``."""
    if f.default is not dataclasses.MISSING and not isinstance(f.default, Record):
        return f.default
    return _missing(hint)


def _missing(hint: Any) -> Any:
    """What a key that is not there reads as."""
    origin, args = _parts(hint)
    if origin is Union:
        return OMITTED if Omitted in args else None
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint._read({}, "", _Reading("", None))
    defaults: dict[Any, Any] = {Mapping: {}, tuple: (), int: 0, bool: False, str: ""}
    return defaults[origin if origin is not None else hint]


_SCALARS: dict[Any, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
    bool: ((bool,), "true or false"),
}


def _decode(value: object, hint: Any, path: str, reading: _Reading) -> Any:
    origin, args = _parts(hint)
    if origin is Union:
        return (
            None
            if value is None and types.NoneType in args
            else _decode(value, _inner(args), path, reading)
        )
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint._read(value, path, reading)
    if hint is Any:
        return value
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise reading.bad(path, "an object", value)
        if args[1] is Any:
            return dict(value)
        return _entries(value, args[1], path, reading)
    if origin is tuple:
        return _sequence(value, args, path, reading)
    kinds, want = _SCALARS[hint]
    if (isinstance(value, bool) and hint is not bool) or not isinstance(value, kinds):
        raise reading.bad(path, want, value)
    return value


def _entries(value: Mapping[Any, Any], hint: Any, path: str, reading: _Reading) -> dict[str, Any]:
    out = {}
    for k, v in value.items():
        try:
            out[str(k)] = _decode(v, hint, f"{path}.{k}", reading)
        except _Bad:
            pass  # recorded; the entry is left out
    return out


def _sequence(value: object, args: tuple[Any, ...], path: str, reading: _Reading) -> Any:
    if not isinstance(value, list | tuple):
        raise reading.bad(path, "a list", value)
    if len(args) == 2 and args[1] is Ellipsis:
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_decode(v, args[0], f"{path}[{i}]", reading))
            except _Bad:
                pass  # recorded; the item is left out
        return tuple(out)
    if len(value) != len(args):
        raise reading.bad(path, f"a list of {len(args)}", value)
    return tuple(
        _decode(v, a, f"{path}[{i}]", reading)
        for i, (v, a) in enumerate(zip(value, args, strict=True))
    )


@typing.dataclass_transform(
    frozen_default=True, kw_only_default=True, field_specifiers=(dataclasses.field,)
)
def record(cls: type[R]) -> type[R]:
    """A frozen, slotted, keyword-only record."""
    return dataclass(frozen=True, slots=True, kw_only=True)(cls)
