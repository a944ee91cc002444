"""Run untrusted, model-written Python against a test snippet, in a sandbox.

The code and the tests go into ``solution.py`` and ``test_solution.py``; a fixed harness,
``kvc_harness.py`` (one script joined from ``_harness_runner``, whose docstring has the details, and
its parts), runs them in two processes: a solution server imports ``solution`` and answers calls,
and a test runner, which never imports or runs the solution's code, runs the tests and then every
``test_*`` function they define, as pytest would, against a module ``solution`` of proxies: ``from
solution import *`` gives the tests one proxy per public callable, which calls into the server
through a pipe of its own. Arguments and results cross as literal values only (numbers, strings,
bytes, None, and lists, tuples, dicts and sets of them, nested); a builtin exception comes back as
the same type with the same arguments, any other as a ``SolutionError`` subclass of the same name.
So there is no object identity across the boundary, no objects or classes (``Stack().push(1)`` fails
with a reason), and of in-place changes to arguments only the final contents of top-level lists,
dicts and sets come back. The tests pass iff the runner ran to its end *and* the process exited 0;
when the server dies (at import, or in a call: ``sys.exit``, ``os._exit``, a signal, a limit), the
runner ends the same way, so the reasons read as they would for one process.

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
"""

from __future__ import annotations

import ast
import contextlib
import functools
import grp
import os
import pwd
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock timeout, the whole process tree is killed after it
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS
    file_size_mb: int = 1  # RLIMIT_FSIZE
    max_procs: int = 0  # extra processes (threads count) the code may create; 0 = no fork
    output_kb: int = 64  # stdout/stderr kept (truncated beyond)


@dataclass(frozen=True, slots=True)
class SandboxResult:
    passed: bool  # tests ran to completion with exit 0
    reason: str  # "tests passed", "AssertionError: ...", "timed out after 10 s", ...
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    network_isolated: bool  # True when the code ran in its own network namespace
    isolation: str  # what isolation was in force
    namespaces_locked: bool = False  # the code could create no namespace (seccomp filter)


Mode = Literal["root-ns", "user-ns", "root-uid", "plain"]

_ENV_PATH = "/usr/bin:/bin"
_UID_BASE, _UID_COUNT = 61000, 2000
_OPEN_FILES = 256
_SETUP_FAILED = 125  # the namespace init's exit status when it could not set up
_REASON_MAX = 300
_TOOLS = ("unshare", "setpriv", "prlimit", "mount", "cp", "env")

# PID 1 of the namespaces, run by /bin/sh as (namespace) root with the host directory as its
# working directory. $1: tmpfs size in KiB, $2: owner uid of the new /tmp; then the command.
_INIT = r"""
set -u
size=$1 owner=$2
shift 2
die() { echo "sandbox setup failed: $*" >&2; exit 125; }
keep_flags() {  # per-mount flags a bind remount must repeat (they are locked in a user namespace)
  local IFS=, o keep=""
  for o in $1; do
    case $o in nosuid|nodev|noexec|noatime|nodiratime|relatime|strictatime) keep="$keep,$o";; esac
  done
  echo "$keep"
}
mounts=$(cat /proc/self/mounts) || die "cannot read /proc/self/mounts"
echo "$mounts" | while read -r _dev mp _type opts _rest; do
  case ",$opts," in *,ro,*) continue;; esac
  mp=$(printf '%b' "$mp")
  mount -o "remount,bind,ro$(keep_flags "$opts")" "$mp" || { echo "read-only $mp" >&2; exit 1; }
done || die "cannot make every mount read-only"
# The host directory stays reachable through the working directory once /tmp is covered.
mount -t tmpfs -o "size=${size}k,nr_inodes=1024,mode=700,uid=$owner,gid=$owner,nosuid,nodev" \
  sandbox /tmp || die "cannot mount /tmp"
cp solution.py test_solution.py kvc_harness.py /tmp/ || die "cannot copy the code"
if [ -d /dev/shm ]; then
  mount -t tmpfs -o "size=${size}k,nr_inodes=64,mode=1777,nosuid,nodev" shm /dev/shm \
    || die "cannot mount /dev/shm"
fi
cd /tmp || die "cannot enter /tmp"
"$@"
exit $?
"""

_HARNESS_FILE = "kvc_harness.py"
_CHANNEL_MAX = 65536  # bytes read back from the result pipe (the harness writes ~100)
_HARNESS_PROCS = 2  # the test runner and the solution server


# The harness's modules in the order the script defines them: what one defines at import time
# another may use, and the runner, whose docstring the script takes, ends it with ``main()``.
_HARNESS_PARTS = (
    "_harness_wire",
    "_harness_lock",
    "_harness_server",
    "_harness_proxy",
    "_harness_runner",
)


@functools.cache
def _harness() -> str:
    """The trusted harness's source, run in the sandbox as one script: the runner's docstring,
    then each part without its docstring, ``from __future__`` and imports of the other parts
    (the script defines them all in one namespace)."""
    here = Path(__file__).parent
    sources = [(here / f"{name}.py").read_text(encoding="utf-8") for name in _HARNESS_PARTS]
    doc = ast.parse(sources[-1]).body[0]
    assert isinstance(doc, ast.Expr) and doc.end_lineno is not None
    head = "".join(sources[-1].splitlines(keepends=True)[doc.lineno - 1 : doc.end_lineno])
    bound: dict[str, tuple[str, str]] = {}
    parts = [_harness_part(n, src, bound) for n, src in zip(_HARNESS_PARTS, sources, strict=True)]
    return "\n\n".join([head + "\nfrom __future__ import annotations\n", *parts])


def _harness_part(name: str, source: str, bound: dict[str, tuple[str, str]]) -> str:
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
    """(name, the import that binds it, or "") for each module-level name a statement binds."""
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


@dataclass(frozen=True, slots=True)
class _Plan:
    mode: Mode
    python: str
    isolation: str

    @property
    def namespaces(self) -> bool:
        return self.mode in ("root-ns", "user-ns")


def run_python(code: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``tests`` against ``code`` in the strongest sandbox this machine allows."""
    return _execute(_plan(), code, tests, limits)


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
    (workdir / _HARNESS_FILE).write_text(_harness(), encoding="utf-8")
    for f in workdir.iterdir():
        f.chmod(0o644)
    if owner is not None:
        os.chown(workdir, owner, owner)


def _supervise(plan: _Plan, workdir: Path, uid: int | None, limits: SandboxLimits) -> SandboxResult:
    nonce = secrets.token_hex(16).encode()
    nonce_r, nonce_w = os.pipe()
    try:
        os.write(nonce_w, nonce)  # far below a pipe's buffer: never blocks
    finally:
        os.close(nonce_w)
    try:
        result_r, result_w = os.pipe()
    except BaseException:
        os.close(nonce_r)
        raise
    try:
        argv, preexec, user = _command(plan, workdir, uid, limits, (nonce_r, result_w))
        home = "/tmp" if plan.namespaces else str(workdir)
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(home),
            start_new_session=True,
            preexec_fn=preexec,
            user=user,
            group=user,
            extra_groups=None if user is None else [],
            pass_fds=(nonce_r, result_w),
        )
    except BaseException:
        os.close(result_r)
        raise
    finally:
        # Only the sandbox holds these ends now: the result pipe reads to its end once the
        # sandbox is gone.
        os.close(nonce_r)
        os.close(result_w)
    try:
        return _watch(plan, proc, start, uid, limits, result_r, nonce)
    finally:
        os.close(result_r)


def _watch(
    plan: _Plan,
    proc: subprocess.Popen[bytes],
    start: float,
    uid: int | None,
    limits: SandboxLimits,
    result_r: int,
    nonce: bytes,
) -> SandboxResult:
    assert proc.stdout is not None and proc.stderr is not None
    out = _Capture(proc.stdout, limits.output_kb * 1024)
    err = _Capture(proc.stderr, limits.output_kb * 1024)
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on KeyboardInterrupt: nothing outlives the call
        _kill_group(proc.pid)
        if uid is not None:
            _kill_uid(uid)
        proc.wait()
    duration = time.monotonic() - start
    returncode: int | None = None
    if not timed_out:
        status = proc.returncode
        returncode = _unwrap_shell_status(status) if plan.namespaces else status
    lock, completed = _read_channel(result_r, nonce)
    stdout, stderr = out.text(), err.text()
    passed = not timed_out and returncode == 0 and completed
    isolation = plan.isolation + (
        ", no new namespaces (seccomp)"
        if lock == "ok"
        else f", namespace creation not blocked ({lock})"
    )
    return SandboxResult(
        passed=passed,
        reason=_reason(passed, timed_out, returncode, completed, stderr, limits),
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        duration_s=duration,
        network_isolated=plan.namespaces,
        isolation=isolation,
        namespaces_locked=lock == "ok",
    )


def _read_channel(fd: int, nonce: bytes) -> tuple[str, bool]:
    """The harness's lock report, and whether the rest of the result pipe is the nonce alone.
    Read without blocking: a process that escaped the kill may still hold the write end."""
    os.set_blocking(fd, False)
    data = bytearray()
    with contextlib.suppress(BlockingIOError):
        while len(data) <= _CHANNEL_MAX and (chunk := os.read(fd, 65536)):
            data += chunk
    head, newline, rest = bytes(data).partition(b"\n")
    if not newline or not head.startswith(b"lock "):
        return "the harness did not start", False
    lock = head[5:].decode("utf-8", errors="replace")
    return lock, secrets.compare_digest(rest, nonce)


def _command(
    plan: _Plan, workdir: Path, uid: int | None, limits: SandboxLimits, channel: tuple[int, int]
) -> tuple[list[str], Callable[[], None] | None, int | None]:
    """argv, the preexec hook setting rlimits (modes without namespaces) and the uid to run as."""
    python = [plan.python, "-I", "-S", "-B", _HARNESS_FILE, *map(str, channel)]
    if not plan.namespaces:
        nproc = _HARNESS_PROCS + limits.max_procs
        if plan.mode == "plain":  # the limit counts this user's tasks, our 2 readers too
            nproc += _tasks_of_uid(os.getuid()) + 2
        return python, functools.partial(_set_rlimits, limits, nproc), uid
    unshare = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
    if plan.mode == "user-ns":
        unshare[1:1] = ["--user", "--map-root-user"]
        drop = [
            "setpriv",
            "--securebits=+noroot,+noroot_locked,+no_setuid_fixup,"
            "+no_setuid_fixup_locked,+keep_caps_locked",
        ]
        owner, nproc = 0, 2 + _HARNESS_PROCS + limits.max_procs  # unshare, the init shell too
    else:
        assert uid is not None
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        owner, nproc = uid, _HARNESS_PROCS + limits.max_procs
    drop += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    tmpfs_kib = 1024 * max(4, 4 * limits.file_size_mb)
    argv = [
        *unshare,
        "--",
        "/bin/sh",
        "-c",
        _INIT,
        "kvcanary-sandbox",
        str(tmpfs_kib),
        str(owner),
        "prlimit",
        *_prlimit_args(limits, nproc),
        "--",
        "env",
        "-i",
        *(f"{k}={v}" for k, v in _env("/tmp").items()),
        *drop,
        *python,
    ]
    return argv, None, None


def _prlimit_args(limits: SandboxLimits, nproc: int) -> list[str]:
    return [f"--{name}={soft}:{hard}" for name, (soft, hard) in _rlimits(limits, nproc).items()]


def _rlimits(limits: SandboxLimits, nproc: int) -> dict[str, tuple[int, int]]:
    """prlimit's names -> (soft, hard). The CPU soft limit sends SIGXCPU, the hard one SIGKILL."""
    memory = limits.memory_mb * 1024 * 1024
    fsize = limits.file_size_mb * 1024 * 1024
    return {
        "cpu": (limits.cpu_s, limits.cpu_s + 1),
        "as": (memory, memory),
        "fsize": (fsize, fsize),
        "nofile": (_OPEN_FILES, _OPEN_FILES),
        "nproc": (nproc, nproc),
        "core": (0, 0),
    }


_RESOURCE = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
    "core": resource.RLIMIT_CORE,
}


def _set_rlimits(limits: SandboxLimits, nproc: int) -> None:
    """preexec hook of the modes without namespaces (runs after Popen switched the uid)."""
    for name, pair in _rlimits(limits, nproc).items():
        resource.setrlimit(_RESOURCE[name], pair)


def _env(home: str) -> dict[str, str]:
    return {"PATH": _ENV_PATH, "LANG": "C.UTF-8", "HOME": home}


def _unwrap_shell_status(status: int) -> int:
    """The init shell reports a signal death of the code as 128+n; turn it back into -n."""
    if 128 < status < 128 + signal.NSIG:
        return -(status - 128)
    return status


# --- reasons ---------------------------------------------------------------------------------


def _reason(
    passed: bool,
    timed_out: bool,
    returncode: int | None,
    completed: bool,
    stderr: str,
    limits: SandboxLimits,
) -> str:
    if passed:
        return "tests passed"
    if timed_out:
        return f"timed out after {limits.wall_s:g} s"
    assert returncode is not None
    if returncode < 0:
        return _signal_reason(-returncode)
    last = _last_line(stderr)
    if returncode == _SETUP_FAILED and last.startswith("sandbox setup failed"):
        return _clip(last)
    if returncode == 0:
        return "exited with status 0 before the tests finished"
    if not last:
        return f"exited with status {returncode}"
    return _clip(_classify(last))


def _signal_reason(sig: int) -> str:
    if sig == signal.SIGXCPU:
        return "killed: CPU time limit"
    if sig == signal.SIGXFSZ:
        return "killed: file size limit"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGKILL:
        return "killed: SIGKILL (CPU time hard limit or out of memory)"
    return f"killed: {name}"


def _classify(line: str) -> str:
    """The exception line, prefixed with the limit it points to when it points to one."""
    if "MemoryError" in line or "Cannot allocate memory" in line:
        return f"memory limit: {line}"
    if "[Errno 27]" in line:  # EFBIG
        return f"file size limit: {line}"
    if "[Errno 11]" in line or "can't start new thread" in line:  # EAGAIN from fork/clone
        return f"process limit: {line}"
    return line


def _last_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def _clip(text: str) -> str:
    return text if len(text) <= _REASON_MAX else text[: _REASON_MAX - 3] + "..."


# --- output ----------------------------------------------------------------------------------


class _Capture:
    """Reads a pipe to its end on a thread; keeps its first and last ``limit / 2`` bytes."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self._stream = stream
        self._head_max = limit // 2
        self._tail_max = limit - self._head_max
        self._head = bytearray()
        self._tail = bytearray()
        self._dropped = 0
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(self._stream.fileno(), 65536):
                self._add(chunk)

    def _add(self, chunk: bytes) -> None:
        room = self._head_max - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        self._tail += chunk
        excess = len(self._tail) - self._tail_max
        if excess > 0:
            del self._tail[:excess]
            self._dropped += excess

    def _join(self) -> None:
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._stream.close()

    def text(self) -> str:
        self._join()
        middle = f"\n[... {self._dropped} bytes truncated ...]\n".encode() if self._dropped else b""
        return bytes(self._head + middle + self._tail).decode("utf-8", errors="replace")


# --- processes and uids ----------------------------------------------------------------------


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _acquire_uid() -> int:
    """A uid of our range that no account has and no process runs as, for this run alone."""
    busy = {uid for _, uid, _ in _processes()}
    start = secrets.randbelow(_UID_COUNT)
    with _uid_lock:
        for i in range(_UID_COUNT):
            uid = _UID_BASE + (start + i) % _UID_COUNT
            if uid in busy or uid in _uids_in_use or _is_account(uid):
                continue
            _uids_in_use.add(uid)
            return uid
    raise RuntimeError("no free sandbox uid")


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _is_account(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def _processes() -> Iterator[tuple[int, int, str]]:
    """(pid, real uid, state letter) of every process, from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            yield int(entry.name), int(fields["Uid"].split()[0]), fields["State"].split()[0]
        except (KeyError, ValueError, IndexError):
            continue


def _tasks_of_uid(uid: int) -> int:
    """Threads of all processes of ``uid``: what RLIMIT_NPROC counts."""
    total = 0
    for pid, owner, _ in _processes():
        if owner == uid:
            with contextlib.suppress(OSError):
                total += max(1, len(os.listdir(f"/proc/{pid}/task")))
    return total


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process of the sandbox uid until none is left (bounded)."""
    for _ in range(50):
        alive = [pid for pid, owner, state in _processes() if owner == uid and state != "Z"]
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
