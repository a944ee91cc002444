"""The code sandbox: right answers pass, wrong ones fail with a reason, and hostile code is stopped.

Every hostile program here is bounded (a fixed number of forks, a fixed allocation, a short wall
timeout), so a missing protection makes a test fail instead of hanging the machine; whatever such
a failure leaves behind is killed by the test.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from replay.checkers.sandbox import run as sandbox_run
from replay.checkers.sandbox.harness import wire
from replay.checkers.sandbox.limits import SandboxLimits
from replay.checkers.sandbox.run import run_python

HOSTILE = SandboxLimits(wall_s=3, cpu_s=2, memory_mb=256, max_procs=2)


def _processes_with(marker: str) -> list[int]:
    """Live processes whose command line carries ``marker`` (besides this one)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes()
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def marker() -> Iterator[str]:
    """A string the test's child processes carry in argv; any survivor is killed afterwards."""
    mark = f"kvcanary-stray-{secrets.token_hex(8)}"
    yield mark
    for pid in _processes_with(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _assert_no_survivors(mark: str) -> None:
    deadline = time.monotonic() + 1.0
    while (left := _processes_with(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"processes outlived the sandbox: {left}"


# --- grading ---------------------------------------------------------------------------------


def test_correct_function_passes() -> None:
    res = run_python(
        "def add(a, b):\n    return a + b\n",
        "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nprint('checked')\n",
    )
    assert res.passed, res
    assert res.reason == "tests passed"
    assert res.returncode == 0
    assert res.stdout == "checked\n"  # the completion marker is not shown
    assert not res.timed_out


def test_wrong_function_fails_with_the_assertion_message() -> None:
    res = run_python(
        "def add(a, b):\n    return a - b\n", "assert add(1, 2) == 3, 'add(1, 2) should be 3'\n"
    )
    assert not res.passed
    assert res.reason == "AssertionError: add(1, 2) should be 3"
    assert res.returncode == 1
    assert "Traceback" in res.stderr


def test_syntax_error_fails_with_the_reason() -> None:
    res = run_python("def add(a, b) return a + b\n", "assert add(1, 2) == 3\n")
    assert not res.passed
    assert res.reason.startswith("SyntaxError")


def test_pytest_style_test_functions_are_called() -> None:
    tests = "def test_add():\n    assert add(2, 2) == 4, 'two and two'\n"
    assert run_python("def add(a, b):\n    return a + b\n", tests).passed
    res = run_python("def add(a, b):\n    return 5\n", tests)
    assert not res.passed
    assert res.reason == "AssertionError: two and two"


def test_exiting_early_with_status_0_is_not_a_pass() -> None:
    res = run_python("import sys\nsys.exit(0)\n", "assert False\n")
    assert not res.passed
    assert res.returncode == 0
    assert "before the tests finished" in res.reason


def test_output_is_truncated_in_the_middle() -> None:
    res = run_python("print('a' * 100_000 + 'END')\n", "", SandboxLimits(output_kb=2))
    assert res.passed, res
    assert len(res.stdout) < 3000
    assert "bytes truncated" in res.stdout
    assert res.stdout.rstrip().endswith("END")


def test_concurrent_runs_do_not_interfere() -> None:
    code = "import os\ndef f():\n    return os.getcwd()\n"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: run_python(code, "assert f()\n"), range(4)))
    assert all(r.passed for r in results), results


# --- hostile code ----------------------------------------------------------------------------


def test_infinite_loop_is_stopped_by_the_cpu_limit() -> None:
    res = run_python("while True:\n    pass\n", "", SandboxLimits(wall_s=5, cpu_s=1))
    assert not res.passed
    assert not res.timed_out
    assert res.reason == "killed: CPU time limit"
    assert res.duration_s < 4


def test_sleeping_forever_is_stopped_by_the_wall_timeout(marker: str) -> None:
    code = f"import time\nMARK = {marker!r}\ntime.sleep(60)\n"
    res = run_python(code, "", SandboxLimits(wall_s=1.5))
    assert not res.passed
    assert res.timed_out
    assert res.returncode is None
    assert res.reason == "timed out after 1.5 s"
    assert 1.5 <= res.duration_s < 3


def _spawn_sleeper(marker: str) -> str:
    """Python source: leave the process group, then become a 30 s sleeper carrying ``marker``."""
    return (
        "os.setsid() if os.getsid(0) != os.getpid() else None; "
        "os.execv(sys.executable, [sys.executable, '-S', '-c', "
        f"'import time; time.sleep(30)', {marker!r}])"
    )


def test_fork_bomb_is_capped_by_the_process_limit(marker: str) -> None:
    code = f"""
import os, sys
made, error = 0, None
for _ in range(50):
    try:
        pid = os.fork()
    except OSError as exc:
        error = exc
        break
    if pid == 0:
        {_spawn_sleeper(marker)}
    made += 1
print(made, type(error).__name__)
"""
    res = run_python(code, "", HOSTILE)
    assert res.passed, res
    made, error = res.stdout.split()
    assert int(made) <= HOSTILE.max_procs
    assert error == "BlockingIOError"
    _assert_no_survivors(marker)


def test_fork_bomb_ends_within_the_wall_timeout_and_leaves_nothing(marker: str) -> None:
    # Every process doubles 8 times (256 without a limit), then all become 30 s sleepers.
    code = f"""
import os, sys
for _ in range(8):
    try:
        os.fork()
    except OSError:
        pass
{_spawn_sleeper(marker)}
"""
    started = time.monotonic()
    res = run_python(code, "", HOSTILE)
    assert time.monotonic() - started < HOSTILE.wall_s + 2
    assert not res.passed
    assert res.timed_out
    _assert_no_survivors(marker)


def test_threads_count_against_the_process_limit() -> None:
    code = "import threading\nthreading.Thread(target=print).start()\n"
    res = run_python(code, "", SandboxLimits(wall_s=5))
    assert not res.passed
    assert res.reason.startswith("process limit")


def test_memory_bomb_fails_with_a_memory_reason() -> None:
    res = run_python("hog = bytearray(2 * 1024 ** 3)\n", "", HOSTILE)
    assert not res.passed
    assert "memory" in res.reason.lower(), res
    assert not res.timed_out


def test_file_size_limit() -> None:
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (2 * 1024 * 1024))\n"
    res = run_python(code, "", SandboxLimits(wall_s=5, file_size_mb=1))
    assert not res.passed
    assert res.reason.startswith("file size limit"), res


def test_writes_outside_its_directory_are_stopped(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    # Directories anyone may write to, where only a read-only filesystem stops the code.
    world_writable = [
        Path(tempfile.mkdtemp(prefix="kvcanary-outside-", dir=d))
        for d in (tempfile.gettempdir(), "/var/tmp")
        if os.path.isdir(d)
    ]
    for d in world_writable:
        d.chmod(0o777)
    targets = [tmp_path / "outside.txt", *(d / "outside.txt" for d in world_writable)]
    code = f"""
import os
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("wrote", path)
    except OSError as exc:
        print("refused", path, exc.errno)
with open("inside.txt", "w") as f:
    f.write("fine")
print("inside ok", os.path.exists("inside.txt"))
"""
    try:
        res = run_python(code, "", HOSTILE)
        assert res.passed, res
        assert "inside ok True" in res.stdout
        assert not targets[0].exists()
        assert f"wrote {targets[0]}" not in res.stdout
        if res.network_isolated:  # namespaces: the whole filesystem is read-only but its own /tmp
            assert not any(t.exists() for t in targets), res.stdout
    finally:
        for d in world_writable:
            shutil.rmtree(d, ignore_errors=True)


def test_network_connections_are_stopped() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
    print("connected")
except OSError as exc:
    print("blocked", type(exc).__name__)
"""
        res = run_python(code, "", HOSTILE)
        if not res.network_isolated:
            pytest.skip(f"no network namespace on this machine: {res.isolation}")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever reached the listener
            listener.accept()[0].close()
    assert res.passed, res
    assert res.stdout.startswith("blocked"), res.stdout


def test_network_namespace_is_used_where_the_machine_allows_it() -> None:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare")
    if subprocess.run([unshare, "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine does not allow network namespaces")
    res = run_python("import socket\nprint(socket.if_nameindex())\n", "")
    assert res.passed, res
    assert res.network_isolated
    assert "net" in res.isolation
    assert res.stdout.strip() == "[(1, 'lo')]"


def test_parent_environment_secrets_are_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{secrets.token_hex(8)}"
    monkeypatch.setenv("KVCANARY_TEST_SECRET", secret)
    code = f"""
import glob, os
print(sorted(os.environ))
print(os.environ.get("KVCANARY_TEST_SECRET"))
for path in ["/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ",
             *glob.glob("/proc/[0-9]*/environ")]:
    try:
        with open(path, "rb") as f:
            print(path, f.read().decode(errors="replace"))
    except OSError as exc:
        print(path, "refused", exc.errno)
"""
    res = run_python(code, "", HOSTILE)
    assert res.passed, res
    assert secret not in res.stdout + res.stderr
    assert res.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH']"


# --- the verdict's channel -------------------------------------------------------------------

# Read every file the code can see beside it (the tests, the harness, anything), print it all
# and every marker-looking token in it, write them to every descriptor, then exit 0 before the
# tests run. A verdict that travelled on stdout, or through a file, would read "passed".
FORGER = r"""
import os, re, sys
seen = []
for d in {os.getcwd(), os.path.dirname(os.path.abspath(__file__)), *sys.path[:1]}:
    try:
        names = os.listdir(d)
    except OSError:
        continue
    for name in names:
        try:
            with open(os.path.join(d, name), "rb") as f:
                seen.append(f.read())
        except OSError:
            pass
blob = b"\n".join(seen)
tokens = set(re.findall(rb"kvcanary-done-[0-9a-f]{32}|\b[0-9a-f]{32}\b", blob))
sys.stdout.buffer.write(blob)
for t in tokens:
    sys.stdout.buffer.write(b"\n" + t + b"\n")
sys.stdout.flush()
for fd in range(3, 64):
    for t in tokens:
        try:
            os.write(fd, t + b"\n")
        except OSError:
            pass
        try:
            os.write(fd, t)
        except OSError:
            pass
for t in tokens:
    sys.stdout.buffer.write(b"\n" + t + b"\n")
sys.stdout.flush()
os._exit(0)
"""


def test_forged_completion_marker_does_not_pass() -> None:
    res = run_python(
        "import os\nprint('\\nkvcanary-done-' + '0' * 32)\nos._exit(0)\n", "assert 1 == 2\n"
    )
    assert not res.passed, res
    assert res.returncode == 0
    assert res.reason == "exited with status 0 before the tests finished"


def test_reading_every_file_and_replaying_it_does_not_pass() -> None:
    res = run_python(FORGER, "assert 1 == 2\n")
    assert not res.passed, res
    assert res.returncode == 0
    assert "assert 1 == 2" in res.stdout  # it did read the tests


def test_the_nonce_pipe_is_empty_and_closed_when_the_solution_runs() -> None:
    code = """
import os
found = []
for fd in range(3, 64):
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 4096)
    except OSError:
        continue
    found.append((fd, data))
print(found)
"""
    res = run_python(code, "")
    assert res.passed, res
    assert res.stdout.strip() == "[]", res.stdout


# --- namespaces ------------------------------------------------------------------------------


def _seccomp_expected() -> str | None:
    """Why this machine cannot lock namespaces, or None where it should."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        return f"no seccomp filter for {os.uname().machine}"
    try:
        status = Path("/proc/self/status").read_text()
    except OSError as exc:
        return f"cannot read /proc/self/status: {exc}"
    if "Seccomp:" not in status:
        return "this kernel has no seccomp"
    return None


NAMESPACES = """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
for name, flag in [("user", 0x10000000), ("net", 0x40000000), ("mount", 0x00020000)]:
    rc = libc.unshare(flag)
    print(name, rc, os.strerror(ctypes.get_errno()) if rc else "created")
cli = subprocess.run(["unshare", "-Ur", "true"], capture_output=True, text=True)
print("unshare-cli", cli.returncode, cli.stderr.strip())
cli = subprocess.run(["unshare", "-Ur", "chroot", "/", "true"], capture_output=True, text=True)
print("chroot", cli.returncode)
"""


def test_code_cannot_create_namespaces() -> None:
    res = run_python(NAMESPACES, "", SandboxLimits(wall_s=10, max_procs=2))
    why = _seccomp_expected()
    if why is not None and not res.namespaces_locked:
        pytest.skip(f"{why}: {res.isolation}")
    assert res.passed, res
    assert res.namespaces_locked, res.isolation
    assert "no new namespaces" in res.isolation
    lines = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
    for name in ("user", "net", "mount"):
        assert lines[name].startswith("-1 "), res.stdout
    assert lines["user"] == "-1 Operation not permitted"
    assert not lines["unshare-cli"].startswith("0"), res.stdout
    assert lines["chroot"] != "0", res.stdout


def test_threads_and_processes_still_start_under_the_lock() -> None:
    # clone3 is answered ENOSYS, so the C library must fall back to clone for both.
    code = """
import subprocess, threading
t = threading.Thread(target=lambda: None)
t.start()
t.join()
print(subprocess.run(["true"]).returncode)
"""
    res = run_python(code, "", SandboxLimits(wall_s=10, max_procs=2))
    assert res.passed, res
    assert res.stdout.strip() == "0"


def test_ptrace_and_reading_other_processes_memory_are_denied() -> None:
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def result(rc):
    return "ok" if rc != -1 else os.strerror(ctypes.get_errno())
print("ptrace", result(libc.ptrace(0, 0, None, None)))          # PTRACE_TRACEME
class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
src, dst = ctypes.create_string_buffer(b"x" * 8), ctypes.create_string_buffer(8)
local, remote = IoVec(ctypes.addressof(dst), 8), IoVec(ctypes.addressof(src), 8)
rc = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
print("process_vm_readv", result(rc))
"""
    res = run_python(code, "")
    why = _seccomp_expected()
    if why is not None and not res.namespaces_locked:
        pytest.skip(f"{why}: {res.isolation}")
    assert res.passed, res
    lines = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
    assert lines == {
        "ptrace": "Operation not permitted",
        "process_vm_readv": "Operation not permitted",
    }, res.stdout


# --- the boundary between the tests and the solution -----------------------------------------

# The tests run in a process of their own, which holds the nonce and never runs the solution's
# code; the solution answers calls from another. Each forger below works against a harness that
# runs both in one interpreter (it was tried on one): called from the tests, it finds the nonce,
# writes it where the verdict is read, and exits 0 before the failing assert.
_FORGE = r"""
import os, re, sys
def _hexes(value):
    if isinstance(value, str):
        value = value.encode("utf-8", "replace")
    if not isinstance(value, (bytes, bytearray)):
        return set()
    return set(re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", bytes(value)))
def _forge(tokens, fds=range(3, 65)):
    print("found", len(tokens), "token(s)", flush=True)
    for fd in fds:
        for t in tokens:
            try:
                os.write(fd, t)
            except OSError:
                pass
    os._exit(0)
"""

FRAME_WALKER = (
    _FORGE
    + r"""
def forge():
    frame, tokens, fds = sys._getframe(), set(), set()
    while frame is not None:
        for name, value in list(frame.f_locals.items()):
            tokens |= _hexes(value)
            if type(value) is int and 3 <= value < 1024 and "fd" in name:
                fds.add(value)
        frame = frame.f_back
    _forge(tokens, sorted(fds))
"""
)

GC_SCANNER = (
    _FORGE
    + r"""
import gc, types
def forge():
    tokens = set()
    for obj in gc.get_objects():
        try:
            if isinstance(obj, types.FrameType):
                values = list(obj.f_locals.values())
            elif isinstance(obj, dict):
                values = list(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                values = list(obj)
            else:
                values = gc.get_referents(obj)
        except Exception:
            continue
        for value in values:
            tokens |= _hexes(value)
    for frame in sys._current_frames().values():
        while frame is not None:
            for value in list(frame.f_locals.values()):
                tokens |= _hexes(value)
            frame = frame.f_back
    _forge(tokens)
"""
)

# Every descriptor gets every token found anywhere: in frames, objects, and whatever any
# descriptor holds.
FD_FLOODER = GC_SCANNER.replace(
    "    _forge(tokens)\n",
    r"""
    for fd in range(3, 65):
        try:
            os.set_blocking(fd, False)
            tokens |= _hexes(os.read(fd, 65536))
        except OSError:
            pass
    _forge(tokens)
""",
)

MEMORY_READER = (
    _FORGE
    + r"""
def forge():
    tokens, refused = set(), []
    for pid in ("self", str(os.getppid())):
        try:
            maps = open(f"/proc/{pid}/maps").read().splitlines()
            mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
        except OSError as exc:
            refused.append(pid if pid == "self" else "parent")
            continue
        with mem:
            for line in maps:
                span, perms = line.split()[:2]
                if not perms.startswith("r") or "[v" in line:
                    continue
                lo, hi = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(lo)
                    blob = mem.read(hi - lo)
                except (OSError, OverflowError, ValueError):
                    continue
                # a bytes object of 32 hex digits: its size (32), its hash, the data, a NUL
                tokens |= set(re.findall(rb"\x20\x00{7}.{8}([0-9a-f]{32})\x00", blob, re.S))
    print("refused", refused, flush=True)
    _forge(tokens)
"""
)


@pytest.mark.parametrize(
    "forger",
    [FRAME_WALKER, GC_SCANNER, FD_FLOODER, MEMORY_READER],
    ids=["frames", "gc", "every-fd", "proc-mem"],
)
def test_solution_code_cannot_find_the_nonce_and_forge_a_pass(forger: str) -> None:
    res = run_python(forger, "forge()\nassert 1 == 2\n", SandboxLimits(wall_s=20, cpu_s=15))
    assert not res.passed, res
    assert res.reason == "exited with status 0 before the tests finished", res
    assert "found" in res.stdout, res  # it ran, and searched
    if forger is MEMORY_READER:  # the test runner is not dumpable
        assert "refused ['parent']" in res.stdout, res.stdout


def test_the_solution_cannot_make_the_tests_import_its_files() -> None:
    # The tests' process imports the standard library only, never from the solution's directory.
    code = "with open('colorsys.py', 'w') as f:\n    f.write('PLANTED = True\\n')\n"
    tests = "import colorsys\nassert not hasattr(colorsys, 'PLANTED'), 'imported a planted file'\n"
    res = run_python(code, tests)
    assert res.passed, res


def test_dunder_names_of_the_solution_do_not_reach_the_tests() -> None:
    # Renaming the tests' module would make their test functions look foreign, and skip them.
    code = "__all__ = ['__name__', 'f']\ndef f():\n    return 1\n"
    res = run_python(code, "def test_f():\n    assert f() == 2, 'ran'\n")
    assert not res.passed, res
    assert res.reason == "AssertionError: ran"


def test_builtin_exceptions_cross_with_their_type_and_arguments() -> None:
    code = """
def parse(s):
    raise ValueError("bad: " + s)
def look(d, k):
    return d[k]
def boom():
    raise OSError(2, "gone")
"""
    tests = """
try:
    parse("x")
except ValueError as exc:
    assert type(exc) is ValueError and str(exc) == "bad: x", repr(exc)
else:
    raise AssertionError("no ValueError")
try:
    look({}, "k")
except KeyError as exc:
    assert exc.args == ("k",), exc.args
try:
    boom()
except FileNotFoundError as exc:
    assert exc.errno == 2 and exc.strerror == "gone"
"""
    res = run_python(code, tests)
    assert res.passed, res
    res = run_python(code, "parse('x')\n")
    assert not res.passed
    assert res.reason == "ValueError: bad: x"


def test_other_exceptions_keep_their_name_and_builtin_bases() -> None:
    code = (
        "class Invalid(ValueError):\n    pass\nclass Odd(Exception):\n"
        "    def __str__(self):\n        return 'odd one'\n"
        "def check(x):\n    raise Invalid('no: %d' % x)\ndef odd():\n    raise Odd()\n"
    )
    tests = """
try:
    check(3)
except ValueError as exc:
    assert type(exc).__name__ == "Invalid" and str(exc) == "no: 3" and exc.args == ("no: 3",)
try:
    odd()
except Exception as exc:
    assert type(exc).__name__ == "Odd" and str(exc) == "odd one", (type(exc), str(exc))
"""
    res = run_python(code, tests)
    assert res.passed, res
    res = run_python(code, "check(3)\n")
    assert res.reason == "solution.Invalid: no: 3"


def test_a_result_that_is_not_a_literal_fails_with_a_reason() -> None:
    code = "def gen(n):\n    yield from range(n)\nclass Box:\n    pass\n"
    res = run_python(code, "assert list(gen(3)) == [0, 1, 2]\n")
    assert not res.passed
    assert res.reason.startswith("SandboxBoundaryError: gen() returned a generator object"), res
    assert "only literal values" in res.reason
    # Not an Exception: a test that expects the solution to raise does not take it for one.
    res = run_python(code, "try:\n    Box()\nexcept Exception:\n    pass\n")
    assert not res.passed
    assert "Box() returned a Box object" in res.reason, res
    res = run_python("def f(g):\n    return g(1)\n", "assert f(lambda x: x) == 1\n")
    assert not res.passed
    assert "an argument of f() is a function object" in res.reason, res


def test_literal_values_cross_intact() -> None:
    code = "def echo(*args, **kwargs):\n    return args, kwargs\n"
    tests = r"""
import math
values = [0, -7, 2 ** 200, -(10 ** 5000), 1.5, -0.0, math.inf, -math.inf, 1e-320, 2 + 3j,
          "", "h\u00e9llo \ud800", b"", bytes(range(256)), True, False, None,
          [1, [2, [3, []]]], (), (1,), ((1, 2), [3]), {"a": {1, 2}, 3: (4,), (5, 6): None},
          set(), frozenset({(1, "x"), frozenset({2})}), {1.5: b"x", None: [], False: 0}]
for v in values:
    args, kwargs = echo(v, key=v)
    assert args == (v,) and kwargs == {"key": v}, (v, args, kwargs)
    assert type(args[0]) is type(v), (v, args[0])
    assert not isinstance(v, float) or repr(args[0]) == repr(v), (v, args[0])
deep = []
for _ in range(60):
    deep = [deep]
assert echo(deep)[0][0] == deep
(nan,), _ = echo(math.nan)
assert math.isnan(nan)
"""
    res = run_python(code, tests)
    assert res.passed, res


def test_module_values_stdlib_modules_and_argument_changes_reach_the_tests() -> None:
    code = """
import math
from collections import Counter
LIMIT = 10
NAMES = ("a", "b")
def letters(s):
    return Counter(s)
def fill(xs, seen, n=1):
    xs.extend(range(n))
    seen["done"] = True
"""
    tests = """
assert LIMIT == 10 and NAMES == ("a", "b")
assert math.isclose(math.pi, 3.14159, rel_tol=1e-5)    # the solution imported math
assert letters("aab") == {"a": 2, "b": 1}
xs, seen = [9], {}
fill(xs, seen, n=2)
assert xs == [9, 0, 1] and seen == {"done": True}, (xs, seen)
"""
    res = run_python(code, tests)
    assert res.passed, res


def test_the_output_of_both_processes_keeps_its_order() -> None:
    code = "print('import')\ndef f(x):\n    print('in f', x)\n    return x\n"
    res = run_python(code, "print('before')\nassert f(1) == 1\nprint('after')\n")
    assert res.passed, res
    assert res.stdout == "import\nbefore\nin f 1\nafter\n"


def test_the_solution_dying_in_a_call_ends_the_run_as_it_died() -> None:
    res = run_python("import os\ndef f():\n    os._exit(0)\n", "f()\nassert 1 == 2\n")
    assert not res.passed
    assert res.returncode == 0
    assert res.reason == "exited with status 0 before the tests finished"
    res = run_python("import ctypes\ndef f():\n    ctypes.string_at(0)\n", "f()\n")
    assert not res.passed
    assert res.reason == "killed: SIGSEGV", res
    res = run_python(
        "def f():\n    while True:\n        pass\n", "f()\n", SandboxLimits(wall_s=10, cpu_s=1)
    )
    assert res.reason == "killed: CPU time limit", res


def test_an_interrupted_call_gets_a_fresh_solution_for_the_next() -> None:
    code = (
        "import time\nprint('imported')\ndef spin():\n    time.sleep(30)\n"
        "def add(a, b):\n    return a + b\n"
    )
    tests = """
import signal
class Late(Exception):
    pass
def late(signum, frame):
    raise Late()
signal.signal(signal.SIGALRM, late)
signal.setitimer(signal.ITIMER_REAL, 0.3)
try:
    spin()
except Late:
    pass
assert add(1, 2) == 3
"""
    res = run_python(code, tests, SandboxLimits(wall_s=10))
    assert res.passed, res
    assert res.stdout == "imported\nimported\n"  # the second import answered add()
    assert res.duration_s < 5


def test_a_solution_process_that_cannot_start_fails_the_run_with_a_reason(tmp_path: Path) -> None:
    # The harness as the sandbox runs it, but with an interpreter that does not exist.
    (tmp_path / "solution.py").write_text("def f():\n    return 1\n")
    (tmp_path / "test_solution.py").write_text("assert f() == 1\n")
    (tmp_path / "kvc_harness.py").write_text(sandbox_run.harness_script())
    nonce_r, nonce_w = os.pipe()
    result_r, result_w = os.pipe()
    os.write(nonce_w, b"0" * 32)
    os.close(nonce_w)
    launcher = (
        "import runpy, sys; sys.executable = '/nonexistent/python'; "
        f"sys.argv = ['kvc_harness.py', '{nonce_r}', '{result_w}']; "
        "runpy.run_path('kvc_harness.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", launcher],
        cwd=tmp_path,
        pass_fds=(nonce_r, result_w),
        capture_output=True,
        text=True,
        timeout=30,
    )
    os.close(nonce_r)
    os.close(result_w)
    with os.fdopen(result_r, "rb") as f:
        channel = f.read()
    assert proc.returncode == 1, proc
    assert proc.stderr.splitlines()[-1].startswith(
        "cannot start the solution's process: FileNotFoundError"
    ), proc.stderr
    assert channel.startswith(b"lock ") and channel.endswith(b"\n"), channel  # no nonce


def test_the_harness_is_one_script_of_its_parts() -> None:
    """The sandbox runs the harness's parts as one script, their imports of each other dropped;
    a part that binds a name another binds (the later would silently win there) is refused."""
    tree = ast.parse(sandbox_run.harness_script())
    runner = ast.parse(
        Path(sandbox_run.__file__).parent.joinpath("harness", "runner.py").read_text()
    )
    assert ast.get_docstring(tree) == ast.get_docstring(runner)
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    with pytest.raises(RuntimeError, match="encode is bound in wire too"):
        sandbox_run.harness_part(
            "proxy", "def encode(v):\n    return v\n", {"encode": ("wire", "")}
        )
    with pytest.raises(RuntimeError, match="imports only its own parts"):
        sandbox_run.harness_part("proxy", "from ..base import Answer\n", {})


@pytest.mark.parametrize(
    "value",
    [
        0,
        -(2**70),
        10**4500,
        0.1,
        float("inf"),
        -0.0,
        1j,
        "x\udcff",
        b"\x00",
        None,
        True,
        [1, (2, {3: frozenset({4})})],
        {"k": [set(), ()]},
    ],
    ids=lambda v: type(v).__name__,
)
def test_the_encoding_round_trips(value: object) -> None:
    data = wire.dumps(wire.encode(value))
    back = wire.decode(json.loads(data))
    assert back == value and type(back) is type(value)
    assert wire.dumps(wire.encode(back)) == data  # -0.0 too


def test_the_decoder_refuses_what_the_encoder_never_makes() -> None:
    for node in [
        {"a": 1},
        ["x", 1],
        [],
        ["d", 1],
        ["i", 5],
        ["c", "1", 2],
        ["s", ["l"]],
        ["b", "zz"],
    ]:
        with pytest.raises((ValueError, TypeError)):
            wire.decode(node)
    deep: list[object] = ["l"]
    for _ in range(wire.MAX_DEPTH + 5):
        deep = ["l", deep]
    with pytest.raises(ValueError):
        wire.decode(deep)
    with pytest.raises(wire.Unsendable):
        wire.encode(object())


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)"
)
def test_a_mount_removed_while_the_sandbox_is_set_up_is_not_a_failure(tmp_path: Path) -> None:
    """Another namespace may unmount something (a network namespace's file, say) between the
    sandbox's reading of the mount list and its remount: gone, it exposes nothing, and the
    setup goes on; a mount that stays writable still fails it."""
    from replay.checkers.sandbox.command import _INIT

    gone, kept = tmp_path / "gone", tmp_path / "kept"
    gone.mkdir()
    kept.mkdir()
    shim = tmp_path / "bin"
    shim.mkdir()
    real = shutil.which("mount")
    # a mount(8) that loses the race for "gone" (unmounts it, then fails), as the host would
    (shim / "mount").write_text(
        f'#!/bin/sh\nfor a; do last=$a; done\nif [ "$last" = "{gone}" ]; then\n'
        f'  umount "{gone}"; exit 32\nfi\nexec {real} "$@"\n'
    )
    (shim / "mount").chmod(0o755)
    for name in ("solution.py", "test_solution.py", "kvc_harness.py"):
        (tmp_path / name).write_text("")
    script = (
        f'mount -t tmpfs t "{gone}" && mount -t tmpfs t "{kept}" && '
        f'PATH="{shim}:$PATH" exec sh -c "$0" sh 1024 0 true'
    )

    def set_up() -> subprocess.CompletedProcess[str]:  # the sandbox's setup in a mount namespace
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, _INIT]
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    done = set_up()
    assert done.returncode == 0, done.stderr
    # the same shim failing a mount that is still there: the setup stops
    (shim / "mount").write_text(
        f'#!/bin/sh\nfor a; do last=$a; done\n[ "$last" = "{kept}" ] && exit 32\nexec {real} "$@"\n'
    )
    done = set_up()
    assert done.returncode == 125 and f"read-only {kept}" in done.stderr, done.stderr
