"""The solution server, the harness's untrusted half: it imports ``solution``, reports its public
names, then answers calls with values, exceptions or the reason a value cannot cross. Part of
the sandbox's harness script (see ``harness.runner``): the standard library only."""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from typing import Any

from .wire import (
    MAX_MESSAGE,
    MAX_VALUE,
    Unsendable,
    _flush,
    _text,
    _write_frame,
    decode,
    dumps,
    encode,
)


def serve(call_fd: int, reply_fd: int, here: str) -> None:
    """Import the solution, report its names, then answer calls until killed."""
    for fd in (call_fd, reply_fd):
        os.set_inheritable(fd, False)
    del sys.argv[1:]
    sys.path.insert(0, here)
    module = importlib.import_module("solution")
    _flush()
    _write_frame(reply_fd, dumps(["hello", _exports(module)]))
    while True:
        body = _read_call(call_fd)
        if body is None:
            return
        reply = _answer(module, body)
        _flush()
        _write_frame(reply_fd, reply)


def _read_call(fd: int) -> bytes | None:
    os.set_blocking(fd, True)  # the solution may have made it non-blocking
    data = b""
    size = None
    while size is None or len(data) < size + 4:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return None
        data += chunk
        if size is None and len(data) >= 4:
            size = int.from_bytes(data[:4], "big")
    return data[4:]


def _exports(module: types.ModuleType) -> list[Any]:
    names = getattr(module, "__all__", None)
    if not isinstance(names, (list, tuple)):
        names = [n for n in vars(module) if not n.startswith("_")]
    out: list[Any] = []
    room = MAX_MESSAGE // 2
    for name in list(names)[:10000]:
        if not isinstance(name, str) or not hasattr(module, name):
            continue
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):
            if getattr(value, "__name__", None) == name:
                out.append(["module", name])
        elif callable(value):
            out.append(["call", name])
        else:
            try:
                node = encode(value)
                size = len(dumps(node))
            except Exception:
                continue
            if size <= min(MAX_VALUE, room):
                out.append(["value", name, node])
                room -= size
    return out


def _answer(module: types.ModuleType, body: bytes) -> bytes:
    try:
        _, name, args_node, kwargs_node = json.loads(body)
        args = [decode(a) for a in args_node]
        kwargs = {str(k): decode(v) for k, v in kwargs_node.items()}
    except Exception:
        return dumps(["boundary", "a malformed call"])
    before = {key: dumps(encode(value)) for key, value in _mutables(args, kwargs)}
    try:
        result = getattr(module, name)(*args, **kwargs)
    except SystemExit:
        raise
    except BaseException as exc:
        return _raised(exc)
    try:
        data = dumps(["ok", encode(result), _changed(args, kwargs, before)])
    except Exception as exc:
        why = _text(exc) if isinstance(exc, Unsendable) else f"{type(exc).__name__}: {_text(exc)}"
        return dumps(
            [
                "boundary",
                f"{name}() returned {why}, which cannot leave the solution's "
                "process: only literal values can (numbers, strings, bytes, None, and "
                "lists, tuples, dicts and sets of them)",
            ]
        )
    if len(data) > MAX_MESSAGE:
        return dumps(
            [
                "boundary",
                f"{name}() returned {len(data):,} bytes of data, more than "
                f"the {MAX_MESSAGE:,} that can leave the solution's process",
            ]
        )
    return data


def _mutables(args: list[Any], kwargs: dict[str, Any]) -> list[tuple[int | str, Any]]:
    pairs: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    return [(k, v) for k, v in pairs if type(v) in (list, dict, set)]


def _changed(args: list[Any], kwargs: dict[str, Any], before: dict[int | str, bytes]) -> list[Any]:
    """The final contents of the top-level list, dict and set arguments the call changed."""
    out = []
    for key, value in _mutables(args, kwargs):
        try:
            node = encode(value)
        except Exception:
            continue  # it now holds what cannot be copied back: left as it was
        if dumps(node) != before.get(key):
            out.append([key, node])
    return out


def _raised(exc: BaseException) -> bytes:
    names = [str(getattr(c, "__name__", "?")) for c in type(exc).__mro__]
    try:
        args = encode(tuple(exc.args))
        if len(dumps(args)) > MAX_VALUE:
            args = None
    except Exception:
        args = None
    return dumps(["raise", names[:50], args, _text(exc)])
