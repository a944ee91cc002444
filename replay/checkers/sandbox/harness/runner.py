"""The trusted harness of the code sandbox (``sandbox.run``), in two processes that share nothing.

``sandbox.run`` joins this module and its parts (``harness.wire``, ``harness.lock``,
``harness.server``, ``harness.proxy``) into one script, their imports of each other dropped and
this docstring first, writes it into the sandbox as ``kvc_harness.py`` and runs it with the
sandbox's own interpreter (``python -I -S -B``): it imports the standard library only, and runs on
any Python 3 the sandbox may have chosen. Nothing in the supervisor imports them except to test
them.

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
its signature) are not there. ``from solution import *`` never takes the name of a builtin
(``range``, ``sorted``, ``len``, ``AssertionError``): the tests run with the builtins they were
written against, whatever the solution defines; a function the task names like a builtin is
reached as ``solution.max`` (or ``from solution import max``). A ``StopIteration`` (or
``StopAsyncIteration``) a call raises comes back as a ``RuntimeError`` caused by it, as PEP 479
has it for generators: ``map`` or ``filter`` would take it for their end, and ``all(map(f, xs))``
pass on the items before it. A test that expects one checks ``RuntimeError`` and its
``__cause__``.

The server's fate is the runner's: when it dies (an exception or ``sys.exit`` at import,
``os._exit``, a signal, a limit), the runner ends the same way (the same exit status, or killed
by the same signal) without the nonce, so the sandbox's reasons read as before; when a call is
interrupted in the runner (a test's alarm), the server is killed and a fresh one imports the
solution again, so later calls still work (module state starts over). A server that cannot be
started is a failed run with the reason on stderr.
"""

from __future__ import annotations

import os
import sys
import types

from .lock import _lock_namespaces, _undumpable
from .proxy import Server, _cannot_start, _solution_module
from .server import serve
from .wire import _flush

_kept: list[object] = []  # the harness's own __main__, still in use once the tests' replaces it


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
