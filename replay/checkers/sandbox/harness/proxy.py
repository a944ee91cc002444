"""The runner's side of the solution server: the proxies the tests call, the server they call into
(started, restarted after an interrupted call, followed to its end), exceptions rebuilt from its
replies, and the tests' module ``solution``. Part of the sandbox's harness script (see
``harness.runner``): the standard library only."""

from __future__ import annotations

import builtins
import importlib
import json
import os
import select
import signal
import sys
import types
from typing import Any, NoReturn

from .wire import MAX_MESSAGE, Unsendable, _flush, _write_frame, decode, dumps, encode

_POLL_MS = 50  # how often a waiting runner checks that the server lives
# Standard-library modules the tests' ``solution`` never imports for the solution (they act
# on import: print, open a browser or a window).
_NO_IMPORT = frozenset(
    {
        "antigravity",
        "this",
        "site",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "__hello__",
        "__phello__",
    }
)


class SandboxBoundaryError(BaseException):
    """A value that cannot cross between the tests and the solution, or a broken exchange."""


class SolutionError(Exception):
    """An exception of a non-builtin type raised by the solution: ``type_name`` and ``message``
    (its ``str``) as the solution's process reported them; ``args`` where they were literals."""

    type_name = "SolutionError"
    message = ""

    def __str__(self) -> str:
        return self.message


class Remote:
    """A callable of the solution, called in the solution's process."""

    def __init__(self, server: Server, name: str) -> None:
        self._server = server
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._server.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.__name__} in the solution's process>"


class Server:
    """The runner's side of the solution server: start it, call into it, restart it."""

    def __init__(self, source: str, here: str) -> None:
        self._source, self._here = source, here
        self.pid: int | None = None
        self._call_w = self._reply_r = -1
        self._ready = False  # started, and its start-up message read

    def start(self) -> None:
        call_r, self._call_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        try:
            for fd in (call_r, reply_w):
                os.set_inheritable(fd, True)
            argv = [
                sys.executable,
                "-I",
                "-S",
                "-B",
                "-c",
                self._source,
                "serve",
                str(call_r),
                str(reply_w),
                self._here,
            ]
            self.pid = os.posix_spawn(sys.executable, argv, dict(os.environ))
        finally:
            os.close(call_r)
            os.close(reply_w)

    def stop(self) -> None:
        self._ready = False
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _status(self.pid, 0)
            self.pid = None
        for fd in (self._call_w, self._reply_r):
            if fd >= 0:
                os.close(fd)
        self._call_w = self._reply_r = -1

    def hello(self) -> list[Any]:
        """The names the solution exports; the runner ends with the server if it dies first."""
        try:
            reply = self._receive()
            if not (
                isinstance(reply, list)
                and len(reply) == 2
                and reply[0] == "hello"
                and isinstance(reply[1], list)
            ):
                self._broken("a malformed start-up message")
        except SandboxBoundaryError as exc:
            _fail(str(exc))
        self._ready = True
        return reply[1]

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            data = dumps(
                ["call", name, [encode(a) for a in args], {k: encode(v) for k, v in kwargs.items()}]
            )
        except Unsendable as why:
            raise SandboxBoundaryError(
                f"an argument of {name}() is {why}, which cannot be "
                "passed to the solution's process: only literal values "
                "can"
            ) from None
        if len(data) > MAX_MESSAGE:
            raise SandboxBoundaryError(f"the arguments of {name}() are too large to pass")
        _flush()  # what the tests printed so far comes before what the call prints
        try:
            if not self._ready:
                self._restart()
            self._send(data)
            reply = self._receive()
        except BaseException:
            # Interrupted mid-call (a test's alarm) or junk on the pipe: the server's state is
            # unknown, so a fresh one takes the next call (or the one after, if this restart
            # is interrupted too).
            self._ready = False
            self._restart()
            raise
        return _outcome(name, reply, args, kwargs)

    def _restart(self) -> None:
        self.stop()
        try:
            self.start()
        except OSError as exc:
            _cannot_start(exc)
        self.hello()

    def _send(self, data: bytes) -> None:
        try:
            _write_frame(self._call_w, data)
        except OSError:
            self._lost()

    def _receive(self) -> Any:
        size = int.from_bytes(self._read(4), "big")
        if size > MAX_MESSAGE:
            self._broken(f"a message of {size:,} bytes")
        try:
            return json.loads(self._read(size))
        except (ValueError, RecursionError, MemoryError):
            self._broken("a malformed message")

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            self._wait_readable()
            chunk = os.read(self._reply_r, min(size - len(data), 1 << 20))
            if not chunk:
                self._lost()
            data += chunk
        return data

    def _wait_readable(self) -> None:
        poller = select.poll()
        poller.register(self._reply_r, select.POLLIN)
        while not poller.poll(_POLL_MS):
            assert self.pid is not None
            status = _status(self.pid, os.WNOHANG)
            if status is not None:  # it died; a process it forked may hold the pipe open
                _end_like(status)

    def _lost(self) -> NoReturn:
        """The server closed its end: it died (or will); end as it ends."""
        assert self.pid is not None
        status = _status(self.pid, 0)
        assert status is not None
        _end_like(status)

    def _broken(self, what: str) -> NoReturn:
        """Junk on the reply pipe: end as the server ends if it is dying, else kill it."""
        assert self.pid is not None
        for _ in range(20):
            status = _status(self.pid, os.WNOHANG)
            if status is not None:
                _end_like(status)
            select.select([], [], [], 0.05)
        self.stop()
        raise SandboxBoundaryError(f"the solution's process sent {what}")


def _status(pid: int, flags: int) -> int | None:
    """The wait status of the server once it ended (None: not yet); exit 1 if it was reaped
    elsewhere (a test that ignores SIGCHLD)."""
    try:
        done, status = os.waitpid(pid, flags)
    except ChildProcessError:
        return 1 << 8
    return status if done else None


def _outcome(name: str, reply: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's value, or its exception raised here, from a reply."""
    try:
        kind = reply[0]
        if kind == "ok":
            value = decode(reply[1])
            for key, node in reply[2]:
                _copy_back(args[key] if type(key) is int else kwargs[key], decode(node))
            return value
        if kind == "raise":
            exc = _exception(
                [str(n) for n in reply[1]],
                None if reply[2] is None else decode(reply[2]),
                str(reply[3]),
            )
        elif kind == "boundary":
            exc = SandboxBoundaryError(str(reply[1]))
        else:
            raise ValueError(kind)
    except Exception:
        exc = SandboxBoundaryError(f"the solution's process sent a malformed reply to {name}()")
    if isinstance(exc, (StopIteration, StopAsyncIteration)):
        # PEP 479's rule for generators, applied to every call. ``map``, ``filter``, ``zip``,
        # ``itertools`` and a test's own ``__next__`` are not generators: a StopIteration out of
        # the function they call reads to them as their end, so ``all(map(f, xs))`` would hold
        # over the items before it and a wrong solution pass. As a RuntimeError it fails the
        # test; the StopIteration stays its ``__cause__``.
        raise RuntimeError(f"{name}() raised {type(exc).__name__}") from exc
    raise exc


def _copy_back(target: Any, value: Any) -> None:
    if isinstance(target, list) and isinstance(value, list):
        target[:] = value
    elif isinstance(target, (dict, set)) and type(value) is type(target):
        target.clear()
        target.update(value)


_remote_types: dict[tuple[str, type], type] = {}


def _builtin_exception(name: str) -> type[BaseException] | None:
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException) and cls is not SystemExit:
        return cls
    return None


def _exception(names: list[str], args: Any, message: str) -> BaseException:
    """The builtin exception of that name, else a SolutionError subclass named as the type."""
    args = tuple(args) if type(args) is tuple else (message,)
    builtin = _builtin_exception(names[0])
    if builtin is not None:
        for attempt in (args, (message,)):
            try:
                return builtin(*attempt)
            except Exception:
                pass
    bases = [b for b in map(_builtin_exception, names[1:]) if b not in (None, BaseException)]
    base = bases[0] if bases else Exception
    exc: SolutionError | None = None
    for attempt in ((SolutionError, base), (SolutionError,)):
        try:
            key = (names[0], attempt[-1])
            if key not in _remote_types:
                _remote_types[key] = type(names[0], attempt, {"__module__": "solution"})
            exc = _remote_types[key](*args)
            break
        except Exception:
            continue
    if exc is None:
        exc = SolutionError(message)
    exc.type_name, exc.message = names[0], message
    return exc


def _end_like(status: int) -> NoReturn:
    """End this process as the server ended: the same signal, or the same exit status."""
    _flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _cannot_start(exc: OSError) -> NoReturn:
    _fail(f"cannot start the solution's process: {type(exc).__name__}: {exc}")


def _fail(reason: str) -> NoReturn:
    """Exit 1 with ``reason`` as the last line of stderr (the sandbox's reason)."""
    _flush()
    sys.stderr.write(reason + "\n")
    _flush()
    os._exit(1)


def _solution_module(server: Server, exports: list[Any]) -> types.ModuleType:
    """The tests' ``solution``: proxies, literal values and standard-library modules."""
    module = types.ModuleType("solution")
    names = []
    for entry in exports:
        try:
            kind, name = entry[0], entry[1]
            if not (isinstance(name, str) and name.isidentifier()) or (
                name.startswith("__") and name.endswith("__")
            ):
                continue
            if kind == "call":
                value: Any = Remote(server, name)
            elif kind == "value":
                value = decode(entry[2])
            elif (
                kind == "module"
                and name in getattr(sys, "stdlib_module_names", ())
                and name not in _NO_IMPORT
            ):
                value = importlib.import_module(name)
            else:
                continue
        except Exception:
            continue
        setattr(module, name, value)
        if not hasattr(builtins, name):
            names.append(name)
    # ``from solution import *`` takes no builtin's name (``range``, ``sorted``, ``len``,
    # ``AssertionError``...): the tests run with the builtins they were written against, so a
    # wrong function cannot pass by redefining what its tests check it with. A solution's own
    # ``max`` is still ``solution.max`` (``import solution``, ``from solution import max``).
    setattr(module, "__all__", names)  # noqa: B010 - not an attribute a ModuleType declares
    return module
