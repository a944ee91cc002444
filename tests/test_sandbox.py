"""The code sandbox: right answers pass, wrong ones fail with a reason, and hostile code is stopped.

Every hostile program here is bounded (a fixed number of forks, a fixed allocation, a short wall
timeout), so a missing protection makes a test fail instead of hanging the machine; whatever such
a failure leaves behind is killed by the test.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from replay.checkers._sandbox import SandboxLimits, run_python

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
    res = run_python("def add(a, b):\n    return a + b\n",
                     "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nprint('checked')\n")
    assert res.passed, res
    assert res.reason == "tests passed"
    assert res.returncode == 0
    assert res.stdout == "checked\n"          # the completion marker is not shown
    assert not res.timed_out


def test_wrong_function_fails_with_the_assertion_message() -> None:
    res = run_python("def add(a, b):\n    return a - b\n",
                     "assert add(1, 2) == 3, 'add(1, 2) should be 3'\n")
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
    return ("os.setsid() if os.getsid(0) != os.getpid() else None; "
            "os.execv(sys.executable, [sys.executable, '-S', '-c', "
            f"'import time; time.sleep(30)', {marker!r}])")


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
    world_writable = [Path(tempfile.mkdtemp(prefix="kvcanary-outside-", dir=d))
                      for d in (tempfile.gettempdir(), "/var/tmp") if os.path.isdir(d)]
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
        if res.network_isolated:   # namespaces: the whole filesystem is read-only but its own /tmp
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
        with pytest.raises(BlockingIOError):   # nothing ever reached the listener
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
    res = run_python("import os\nprint('\\nkvcanary-done-' + '0' * 32)\nos._exit(0)\n",
                     "assert 1 == 2\n")
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
