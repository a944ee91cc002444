"""Run untrusted, model-written Python against a test snippet, in a sandbox.

The code and the tests go into ``solution.py`` and ``test_solution.py``; a fixed harness,
``kvc_harness.py`` (one script joined from ``harness.runner``, whose docstring has the details, and
its parts), runs them in two processes: a solution server imports ``solution`` and answers calls,
and a test runner, which never imports or runs the solution's code, runs the tests and then every
``test_*`` function they define, as pytest would, against a module ``solution`` of proxies: ``from
solution import *`` gives the tests one proxy per public callable, which calls into the server
through a pipe of its own. Arguments and results cross as literal values only (numbers, strings,
bytes, None, and lists, tuples, dicts and sets of them, nested); a builtin exception comes back as
the same type with the same arguments (but ``StopIteration``, which would end a ``map`` early:
it comes back as the ``RuntimeError`` PEP 479 makes of it), any other as a ``SolutionError``
subclass of the same name. So there is no object identity across the boundary, no objects or
classes (``Stack().push(1)`` fails with a reason), and of in-place changes to arguments only the
final contents of top-level lists, dicts and sets come back. The tests pass iff the runner ran
to its end *and* the process exited 0; when the server dies (at import, or in a call:
``sys.exit``, ``os._exit``, a signal, a limit), the runner ends the same way, so the reasons read
as they would for one process.

The verdict's channel. "Ran to its end" must not be something the solution can say: it can print
anything, exit with any status at any time, and read every file beside it (the harness, the
tests). So the proof is a fresh random nonce (128 bits) that is in no file, argument or variable
of the environment: the supervisor writes it into a pipe before the sandbox starts, and passes
the pipe's read end and the write end of a second, result pipe as inherited descriptors (their
numbers are the harness's arguments). The runner makes itself non-dumpable, installs the
namespace lock below, starts the server (by exec: it inherits neither pipe nor any memory of the
runner's) and only then reads the nonce, closes the nonce pipe, and writes one trusted line to
the result pipe (whether the lock holds); after the last test it writes the nonce there. The
supervisor requires the result pipe to hold exactly that line and the nonce, and the exit status
0: output on stdout/stderr counts for nothing, an early exit never wrote the nonce, junk written
to the result pipe spoils it, and reading files or the nonce pipe (empty and closed) yields
nothing. The solution's code runs only in the server, which never held the nonce: walking its
frames or its objects finds nothing, and the runner's memory and descriptors are out of its
reach (``/proc/PID/mem`` and ``/proc/PID/fd`` of a non-dumpable process, ``ptrace``,
``process_vm_readv`` and ``pidfd_getfd`` are refused). What the server sends back is only ever
parsed into builtin values, never run, so no object equal to everything reaches the tests.

The namespace lock. Before the server starts, the runner installs a seccomp filter (with
``no_new_privs``; it holds for the server and every process the code starts) under which
``unshare``, ``clone`` with any ``CLONE_NEW*`` flag, ``setns``, ``ptrace``, ``process_vm_readv``,
``process_vm_writev`` and ``pidfd_getfd`` fail with EPERM, ``clone3`` (whose flags a filter
cannot read) with ENOSYS so that the C library falls back to ``clone``, and every system call of
another ABI (32-bit, x32) with ENOSYS. Without it the unprivileged code could create a
user namespace, and in it network and mount namespaces and a ``chroot``: no escape, but the
first step of many. Where the kernel or architecture (x86-64 and AArch64 are known) does not
allow the filter, ``SandboxResult.namespaces_locked`` is False and ``isolation`` says why.

Isolation, strongest first; the first the machine allows is found once per process (a probe runs
the real sandbox on a tiny program) and named in ``SandboxResult.isolation``:

``root-ns`` (running as root, ``unshare`` allowed)
    ``unshare --net --pid --mount --fork``: a network namespace (only ``lo``, down: nothing can be
    reached, not even this machine's 127.0.0.1), a PID namespace (the code sees only its own
    processes; when the sandbox ends, the kernel kills whatever it left behind) and a mount
    namespace in which every mount is remounted read-only and ``/tmp`` is a fresh, size-limited
    tmpfs holding just the two files (the working directory; ``/dev/shm`` is another one). A root
    shell stays PID 1 of the namespace; the code runs under it as a dedicated unprivileged uid
    (61000 + n, not in /etc/passwd, one per concurrent run), with no capabilities and
    ``no_new_privs``. The uid matters because root ignores RLIMIT_NPROC: as that uid the process
    limit holds, and the rest of the filesystem is root's anyway.
``user-ns`` (not root, unprivileged user namespaces allowed)
    The same namespaces inside a user namespace; the code keeps uid 0 *of that namespace* but
    runs with every capability dropped (securebits ``noroot``), so it cannot undo the read-only
    mounts. RLIMIT_NPROC counts only the namespace's processes (``unshare``, the shell, the code).
``root-uid`` / ``plain`` (no namespaces)
    A separate process in its own session with the same resource limits, in an empty temporary
    directory; ``root-uid`` also drops to the dedicated uid. There is no network isolation
    (``network_isolated`` is False and ``isolation`` says why) and world-writable places such as
    ``/tmp`` stay writable; in ``plain`` mode the process limit counts all of this user's
    processes, so it is approximate.

Always: a scrubbed environment (PATH, LANG, HOME only), ``python -I -S -B`` (no site, no user
paths, no PYTHON* variables), rlimits on CPU time (SIGXCPU at ``cpu_s``, SIGKILL a second later),
address space, file size, open files, processes (threads count too) and core dumps, a wall
timeout after which the whole process group is SIGKILLed, and, afterwards, a sweep that kills any
process still running as the sandbox uid. The runner and the server run under the same uid, in
the same namespaces, each with these rlimits (the CPU and memory limits are per process; the
process limit counts both, and ``max_procs`` more); a server the runner restarts after an
interrupted call starts with a fresh CPU limit, the wall timeout bounds them all. stdout and
stderr (shared by both processes) are read as they come and truncated in the middle beyond
``output_kb``.

Not covered: files that any user may read stay readable (read-only, not hidden), and as root the
interpreter is one any uid can run (``sys.executable`` when its path allows, else the system's
``python3``), so the code gets that Python's standard library and nothing else. The server may
signal the runner (stopping or killing it fails the run; it cannot make it pass). In ``plain``
mode the code runs as the supervisor's own user, who may read the supervisor's memory (and
the nonce in it) where the kernel's ptrace policy allows, write the standard library the runner
imports where this user owns it, and, from a process left over by an earlier run, open the
runner's memory in the moment before it turns non-dumpable.

Here: ``run_python``, the harness script and the choice of isolation. Beside it:
``sandbox.limits`` (limits, plan, result), ``sandbox.command`` (the command line and its
limits), ``sandbox.supervise`` (one run and its verdict), ``sandbox.output`` (captured output,
reasons) and ``sandbox.procs`` (uids, processes, kills).
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from replay.checkers.sandbox.command import _ENV_PATH, _HARNESS_FILE
from replay.checkers.sandbox.limits import Mode, SandboxLimits, SandboxResult, _Plan
from replay.checkers.sandbox.procs import _acquire_uid, _release_uid
from replay.checkers.sandbox.supervise import _supervise

_TOOLS = ("unshare", "setpriv", "prlimit", "mount", "cp", "env")  # what the namespaced modes run


def run_python(code: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``tests`` against ``code`` in the strongest sandbox this machine allows."""
    return _execute(_plan(), code, tests, limits)


# --- the harness script ----------------------------------------------------------------------

# The harness's modules in the order the script defines them: what one defines at import time
# another may use, and the runner, whose docstring the script takes, ends it with ``main()``.
_HARNESS_PARTS = ("wire", "lock", "server", "proxy", "runner")


@functools.cache
def harness_script() -> str:
    """The trusted harness's source, run in the sandbox as one script: the runner's docstring,
    then each part without its docstring, ``from __future__`` and imports of the other parts
    (the script defines them all in one namespace)."""
    here = Path(__file__).parent / "harness"
    sources = [(here / f"{name}.py").read_text(encoding="utf-8") for name in _HARNESS_PARTS]
    doc = ast.parse(sources[-1]).body[0]
    assert isinstance(doc, ast.Expr) and doc.end_lineno is not None
    head = "".join(sources[-1].splitlines(keepends=True)[doc.lineno - 1 : doc.end_lineno])
    bound: dict[str, tuple[str, str]] = {}
    parts = [harness_part(n, src, bound) for n, src in zip(_HARNESS_PARTS, sources, strict=True)]
    return "\n\n".join([head + "\nfrom __future__ import annotations\n", *parts])


def harness_part(name: str, source: str, bound: dict[str, tuple[str, str]]) -> str:
    """One part's source as the script holds it. A name that two parts bind would silently be
    the later one's in the script: refused (but for the same import), as is a relative import
    of anything but a part."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source, filename=f"{name}.py")
    drop: set[int] = set()
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.ImportFrom) and (node.level or node.module == "__future__"):
            if node.level and (node.level != 1 or node.module not in _HARNESS_PARTS):
                raise RuntimeError(f"{name}: the harness imports only its own parts")
        elif not (i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            for new, how in _binds(node):
                if new in bound and (not how or bound[new][1] != how):
                    raise RuntimeError(f"{name}: {new} is bound in {bound[new][0]} too")
                bound[new] = (name, how)
            continue
        assert node.end_lineno is not None
        drop.update(range(node.lineno - 1, node.end_lineno))
    return "".join(line for n, line in enumerate(lines) if n not in drop).strip("\n") + "\n"


def _binds(node: ast.stmt) -> list[tuple[str, str]]:
    """(name, the import that binds it, or "") for each name a top-level statement binds (the
    parts bind none inside an ``if`` or a ``try``)."""
    if isinstance(node, ast.Import):
        return [(a.asname or a.name.split(".")[0], f"import {a.name}") for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [(a.asname or a.name, f"from {node.module} import {a.name}") for a in node.names]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [(node.name, "")]
    targets = node.targets if isinstance(node, ast.Assign) else []
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    return [(n.id, "") for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


# --- choosing the isolation ------------------------------------------------------------------


_plan_lock = threading.Lock()


def _plan() -> _Plan:
    with _plan_lock:  # one probe, even when the first runs start together
        return _choose_plan()


@functools.cache
def _choose_plan() -> _Plan:
    """The strongest mode that works here (probed once: the real sandbox on a tiny program)."""
    missing = [t for t in _TOOLS if shutil.which(t, path=_ENV_PATH) is None]
    if os.geteuid() != 0:
        why = f"missing {', '.join(missing)}" if missing else _probe("user-ns", sys.executable)
        if why is None:
            return _Plan(
                "user-ns",
                sys.executable,
                "user+net+pid+mount namespaces (read-only "
                "filesystem, tmpfs /tmp, no capabilities), rlimits",
            )
        return _Plan(
            "plain",
            sys.executable,
            f"rlimits only (no network namespace: {why}; "
            "process limit approximate, this user's files writable)",
        )
    pythons = _unprivileged_pythons()
    if not pythons:
        return _Plan(
            "plain",
            sys.executable,
            "rlimits only, as root (no network namespace, "
            "no Python that an unprivileged uid can run)",
        )
    why = f"missing {', '.join(missing)}" if missing else "not probed"
    for python in [] if missing else pythons:
        why = _probe("root-ns", python)
        if why is None:
            return _Plan(
                "root-ns",
                python,
                "net+pid+mount namespaces (read-only filesystem, "
                "tmpfs /tmp), unprivileged uid, rlimits",
            )
    return _Plan(
        "root-uid",
        pythons[0],
        f"unprivileged uid+rlimits only (no network "
        f"namespace: {why}; world-writable directories writable)",
    )


def _probe(mode: Mode, python: str) -> str | None:
    """None when ``mode`` works with ``python`` (and really has no network), else why not."""
    tests = (
        "import socket\n"
        "assert [n for _, n in socket.if_nameindex()] == ['lo'], socket.if_nameindex()\n"
    )
    try:
        res = _execute(_Plan(mode, python, mode), "", tests, SandboxLimits(wall_s=30))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if res.passed else res.reason


def _unprivileged_pythons() -> list[str]:
    """Interpreters any uid may run (the venv's may live under root's 0700 home)."""
    candidates = [
        sys.executable,
        getattr(sys, "_base_executable", sys.executable),
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "",
    ]
    found: list[str] = []
    for c in candidates:
        real = os.path.realpath(c) if c else ""
        if real and real not in found and _others_can_run(Path(real)):
            found.append(real)
    return found


def _others_can_run(path: Path) -> bool:
    try:
        if path.stat().st_mode & 0o005 != 0o005:
            return False
        return all(p.stat().st_mode & 0o001 for p in path.parents)
    except OSError:
        return False


# --- one run ---------------------------------------------------------------------------------


def _execute(plan: _Plan, code: str, tests: str, limits: SandboxLimits) -> SandboxResult:
    uid = _acquire_uid() if plan.mode in ("root-ns", "root-uid") else None
    workdir = Path(tempfile.mkdtemp(prefix="kvcanary-sandbox-"))
    try:
        _write_files(workdir, code, tests, uid if plan.mode == "root-uid" else None)
        return _supervise(plan, workdir, uid, limits)
    finally:
        if uid is not None:
            _release_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)


def _write_files(workdir: Path, code: str, tests: str, owner: int | None) -> None:
    (workdir / "solution.py").write_text(code, encoding="utf-8")
    (workdir / "test_solution.py").write_text(tests + "\n", encoding="utf-8")
    (workdir / _HARNESS_FILE).write_text(harness_script(), encoding="utf-8")
    for f in workdir.iterdir():
        f.chmod(0o644)
    if owner is not None:
        os.chown(workdir, owner, owner)
