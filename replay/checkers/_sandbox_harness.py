"""The trusted harness of the code sandbox (``_sandbox``), in two processes that share nothing.

``_sandbox`` copies this file into the sandbox as ``kvc_harness.py`` and runs it with the
sandbox's own interpreter (``python -I -S -B``): it imports the standard library only, and runs on
any Python 3 the sandbox may have chosen. Nothing in the supervisor imports it except to test it.

The test runner (``kvc_harness.py NONCE_FD RESULT_FD``) never imports or runs the solution's code.
It makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: a process of the same uid can neither attach
to it nor open its ``/proc/PID/mem`` or ``/proc/PID/fd``), installs the seccomp filter (which
also denies ``ptrace``, ``process_vm_readv``/``writev`` and ``pidfd_getfd`` to every process
below it), reads the tests and its own source, takes every directory the solution may write to
off ``sys.path``, and starts the solution server; only then does it read the nonce, so the server
never held it, nor the nonce or result pipe (they close on exec). The tests run in the runner, in
a fresh ``__main__``, against a module ``solution`` of proxies (``from solution import *`` and
``import solution`` both find it); after the last test it kills the server and writes the nonce.

The solution server (``python -c SOURCE serve CALL_FD REPLY_FD DIR``, spawned by exec, so its
memory holds nothing of the runner's) inherits the filter, the rlimits and the uid, imports
``solution``, reports its public names (``__all__``, else those without a leading ``_``), and then
answers calls on two pipes of its own: stdout and stderr stay the solution's, captured as before.
Each public name becomes, in the runner: a proxy when it is callable; its value when it is a
literal; the runner's own import of the same standard-library module when it is a module of the
same name (``import math``); nothing otherwise. Dunder names are never taken.

A call sends its name and its arguments; what comes back is a value, or an exception: one of the
same builtin type with the same arguments where the type is a builtin one (so ``except
ValueError`` and ``str(exc)`` work), else a ``SolutionError`` subclass named as the solution's
type (``type(exc).__name__``), that also derives from the first builtin exception among its bases.
Values are literals only: None, bool, int (any size), float (inf and nan too), complex, str,
bytes, and lists, tuples, dicts, sets and frozensets of them, nested at most ``MAX_DEPTH`` deep,
at most ``MAX_MESSAGE`` bytes a message; subclasses travel as their base type (a ``Counter`` as a
``dict``, a named tuple as a ``tuple``). The encoding is JSON of tagged arrays (every container
tagged with its type), parsed by the C decoder and rebuilt from builtin types only: nothing the
solution sends is ever called or executed by the runner. A call whose result is not a literal (an
object, a generator, a function), or whose arguments are not, raises ``SandboxBoundaryError``
(a ``BaseException``, so that no ``except Exception`` in a test takes it for the solution's
exception), which fails the test with its reason.

Limits of the boundary, for those who write tests: no object identity (every call gets copies);
of in-place changes to arguments, only the final contents of top-level list, dict and set
arguments are copied back; no objects or classes (``Stack().push(1)`` fails: the instance cannot
cross); module-level values are copied once, at start-up; a callable's attributes (``__doc__``,
its signature) are not there. The solution may still export names that shadow the tests'
builtins, as ``from solution import *`` always let it, but what they return are literals.

The server's fate is the runner's: when it dies (an exception or ``sys.exit`` at import,
``os._exit``, a signal, a limit), the runner ends the same way (the same exit status, or killed
by the same signal) without the nonce, so the sandbox's reasons read as before; when a call is
interrupted in the runner (a test's alarm), the server is killed and a fresh one imports the
solution again, so later calls still work (module state starts over). A server that cannot be
started is a failed run with the reason on stderr.
"""

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

MAX_DEPTH = 100
MAX_MESSAGE = 16 * 1024 * 1024  # bytes of one call or reply
MAX_VALUE = 1024 * 1024  # bytes of a module-level value or an exception's args
_TEXT_MAX = 2000  # characters of an exception's message
_BIG = 10**4000  # larger ints travel in hex (decimal conversion is limited)
_POLL_MS = 50  # how often a waiting runner checks that the server lives
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
_SEQUENCES: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_BUILD: dict[str, Any] = {"l": list, "t": tuple, "s": set, "f": frozenset}
_ATOMS = (type(None), bool, str, float)
_BASES: tuple[Any, ...] = (int, float, str, bytes, complex, tuple, list, dict, set, frozenset)


class SandboxBoundaryError(BaseException):
    """A value that cannot cross between the tests and the solution, or a broken exchange."""


class SolutionError(Exception):
    """An exception of a non-builtin type raised by the solution: ``type_name`` and ``message``
    (its ``str``) as the solution's process reported them; ``args`` where they were literals."""

    type_name = "SolutionError"
    message = ""

    def __str__(self) -> str:
        return self.message


class Unsendable(Exception):
    """``encode`` met something that is not a literal."""


# --- values ----------------------------------------------------------------------------------


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


# --- the solution server ---------------------------------------------------------------------


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


# --- the test runner -------------------------------------------------------------------------


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
    raise exc


def _copy_back(target: Any, value: Any) -> None:
    if isinstance(target, list) and isinstance(value, list):
        target[:] = value
    elif isinstance(target, (dict, set)) and type(value) is type(target):
        target.clear()
        target.update(value)


_remote_types: dict[tuple[str, type], type] = {}
_kept: list[object] = []


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
        names.append(name)
    setattr(module, "__all__", names)  # noqa: B010 - not an attribute a ModuleType declares
    return module


def _prctl() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ulong = ctypes.c_ulong
    libc.prctl.argtypes = [ctypes.c_int, ulong, ulong, ulong, ulong]
    return libc.prctl


def _undumpable() -> str:
    """PR_SET_DUMPABLE 0: "ok" or why not."""
    try:
        import ctypes

        if _prctl()(4, 0, 0, 0, 0) != 0:
            return "not undumpable: " + os.strerror(ctypes.get_errno())
        return "ok"
    except Exception as exc:
        return f"not undumpable: {type(exc).__name__}: {exc}"


# arch, unshare, clone, clone3, setns, ptrace, process_vm_readv, process_vm_writev, pidfd_getfd
_SYSCALLS = {
    "x86_64": (0xC000003E, 272, 56, 435, 308, 101, 310, 311, 438),
    "aarch64": (0xC00000B7, 97, 220, 435, 268, 117, 270, 271, 438),
}


def _seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    arch, unshare, clone, clone3, setns, ptrace, vm_read, vm_write, getfd = _SYSCALLS[machine]
    allow, errno, eperm, enosys = 0x7FFF0000, 0x00050000, 1, 38
    new_ns = 0x7E020080  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}
    ld, ja, jeq, jge, jset, ret = 0x20, 0x05, 0x15, 0x35, 0x45, 0x06
    return [
        (ld, 0, 0, 4),
        (jeq, 1, 0, arch),
        (ret, 0, 0, errno | enosys),  # 0-2
        (ld, 0, 0, 0),
        (jge, 0, 1, 0x40000000),
        (ret, 0, 0, errno | enosys),  # 3-5
        (jeq, 0, 1, clone3),
        (ret, 0, 0, errno | enosys),  # 6-7
        (jeq, 5, 0, setns),
        (jeq, 4, 0, ptrace),
        (jeq, 3, 0, vm_read),  # 8-10
        (jeq, 2, 0, vm_write),
        (jeq, 1, 0, getfd),
        (ja, 0, 0, 1),  # 11-13
        (ret, 0, 0, errno | eperm),  # 14
        (jeq, 2, 0, unshare),
        (jeq, 1, 0, clone),
        (ret, 0, 0, allow),  # 15-17
        (ld, 0, 0, 16),
        (jset, 0, 1, new_ns),
        (ret, 0, 0, errno | eperm),  # 18-20
        (ret, 0, 0, allow),  # 21
    ]


def _lock_namespaces() -> str:
    """Install the seccomp filter of ``_sandbox``'s docstring; "ok" or why not."""
    try:
        import ctypes

        machine = os.uname().machine
        if machine not in _SYSCALLS:
            return "no seccomp filter for " + machine
        program = _seccomp_program(machine)

        class Insn(ctypes.Structure):
            _fields_ = [
                ("code", ctypes.c_ushort),
                ("jt", ctypes.c_ubyte),
                ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32),
            ]

        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

        insns = (Insn * len(program))(*(Insn(*i) for i in program))
        prog = Prog(len(program), insns)
        prctl = _prctl()
        if prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return "no_new_privs: " + os.strerror(ctypes.get_errno())
        if prctl(22, 2, ctypes.addressof(prog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
            return "seccomp: " + os.strerror(ctypes.get_errno())
        return "ok"
    except Exception as exc:
        return f"seccomp: {type(exc).__name__}: {exc}"


def run_tests(nonce_fd: int, result_fd: int) -> None:
    """The runner: everything trusted is read, the server started, before the nonce is."""
    for fd in (nonce_fd, result_fd):
        os.set_inheritable(fd, False)
    del sys.argv[1:]
    dumpable = _undumpable()
    lock = _lock_namespaces()
    if lock == "ok" and dumpable != "ok":
        lock = dumpable
    me = os.path.abspath(__file__)
    here = os.path.dirname(me)
    path = os.path.join(here, "test_solution.py")
    with open(path, encoding="utf-8") as f:
        tests = compile(f.read(), path, "exec")
    with open(me, encoding="utf-8") as f:
        source = f.read()
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath(here)]
    server = Server(source, here)
    try:
        server.start()
        failed = None
    except OSError as exc:
        failed = exc
    nonce = os.read(nonce_fd, 64)
    os.close(nonce_fd)
    os.write(result_fd, ("lock " + lock.replace("\n", " ") + "\n").encode())
    if failed is not None:
        _cannot_start(failed)
    sys.modules["solution"] = _solution_module(server, server.hello())
    try:
        _run(tests, me)
    finally:  # before a failing test's traceback: nothing the server prints comes after it
        _flush()
        server.stop()
    os.write(result_fd, nonce)


def _run(tests: types.CodeType, me: str) -> None:
    """The tests, in a fresh ``__main__`` (this module's functions keep their own globals)."""
    _kept.append(sys.modules["__main__"])  # this module, still in use
    main = types.ModuleType("__main__")
    main.__file__ = me
    sys.modules["__main__"] = main
    namespace = main.__dict__
    exec("from solution import *", namespace)
    exec(tests, namespace)
    for name, fn in list(namespace.items()):
        code = getattr(fn, "__code__", None)
        if (
            name.startswith("test_")
            and code is not None
            and code.co_argcount == 0
            and getattr(fn, "__module__", None) == "__main__"
        ):
            fn()


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        run_tests(int(sys.argv[1]), int(sys.argv[2]))


if __name__ == "__main__":
    main()
