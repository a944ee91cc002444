"""What crosses between the harness's two processes: literal values as tagged JSON (``encode``,
``decode``: builtin types only, nested at most ``MAX_DEPTH`` deep), length-prefixed frames, and
the flush both sides do before they write. Part of the sandbox's harness script (see
``harness.runner``): the standard library only."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

MAX_DEPTH = 100
MAX_MESSAGE = 16 * 1024 * 1024  # bytes of one call or reply
MAX_VALUE = 1024 * 1024  # bytes of a module-level value or an exception's args
_TEXT_MAX = 2000  # characters of an exception's message
_BIG = 10**4000  # larger ints travel in hex (decimal conversion is limited)
_SEQUENCES: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_BUILD: dict[str, Any] = {"l": list, "t": tuple, "s": set, "f": frozenset}
_ATOMS = (type(None), bool, str, float)
_BASES: tuple[Any, ...] = (int, float, str, bytes, complex, tuple, list, dict, set, frozenset)


class Unsendable(Exception):
    """``encode`` met something that is not a literal."""


def encode(value: object, depth: int = 0) -> Any:
    """A literal as JSON-able data: atoms as they are, every container a tagged array."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is int:
        assert isinstance(value, int)
        return value if -_BIG < value < _BIG else ["i", format(value, "x")]
    if depth >= MAX_DEPTH:
        raise Unsendable(f"a value nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, bytes) and kind is bytes:
        return ["b", value.hex()]
    if isinstance(value, complex) and kind is complex:
        return ["c", value.real, value.imag]
    if kind in _SEQUENCES:
        assert isinstance(value, (list, tuple, set, frozenset))
        return [_SEQUENCES[kind], *(encode(v, depth + 1) for v in value)]
    if isinstance(value, dict) and kind is dict:
        out: list[Any] = ["d"]
        for k, v in value.items():
            out += (encode(k, depth + 1), encode(v, depth + 1))
        return out
    for base in _BASES:
        if isinstance(value, base):  # a subclass travels as its base type
            return encode(base(value), depth + 1)
    raise Unsendable(f"a {kind.__name__} object")


def decode(node: Any, depth: int = 0) -> Any:
    """The value ``encode`` made ``node`` from; ValueError or TypeError for anything else."""
    kind = type(node)
    if kind in _ATOMS or kind is int:
        return node
    if kind is not list or not node or type(node[0]) is not str or depth > MAX_DEPTH:
        raise ValueError("not an encoded value")
    tag, items = node[0], node[1:]
    if tag in _BUILD:
        return _BUILD[tag](decode(v, depth + 1) for v in items)
    if tag == "d" and len(items) % 2 == 0:
        return {
            decode(items[i], depth + 1): decode(items[i + 1], depth + 1)
            for i in range(0, len(items), 2)
        }
    if len(items) == 1 and type(items[0]) is str:
        if tag == "i":
            return int(items[0], 16)
        if tag == "b":
            return bytes.fromhex(items[0])
    if tag == "c" and len(items) == 2 and all(type(x) in (int, float) for x in items):
        return complex(items[0], items[1])
    raise ValueError("not an encoded value")


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def _text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = "<unprintable>"
    return text[:_TEXT_MAX]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
