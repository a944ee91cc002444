"""The sandbox's command line: the namespaces (``unshare``) and their init shell that makes the
filesystem read-only and ``/tmp`` a fresh tmpfs, the dropped privileges (``setpriv``), the
rlimits (``prlimit``, or a preexec hook where there are no namespaces), the scrubbed
environment, and the harness started as ``python -I -S -B kvc_harness.py NONCE_FD RESULT_FD``."""

from __future__ import annotations

import functools
import os
import resource
import signal
from collections.abc import Callable
from pathlib import Path

from replay.checkers.sandbox.limits import SandboxLimits, _Plan
from replay.checkers.sandbox.procs import _tasks_of_uid

_ENV_PATH = "/usr/bin:/bin"
_OPEN_FILES = 256
_HARNESS_FILE = "kvc_harness.py"  # the harness script's name in the sandbox (_INIT copies it)
_HARNESS_PROCS = 2  # the test runner and the solution server


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
still_mounted() {  # $1 as /proc/self/mounts writes it (a mount the host removed meanwhile)
  awk -v m="$1" '$2 == m { found = 1 } END { exit !found }' /proc/self/mounts
}
echo "$mounts" | while read -r _dev raw _type opts _rest; do
  case ",$opts," in *,ro,*) continue;; esac
  mp=$(printf '%b' "$raw")
  mount -o "remount,bind,ro$(keep_flags "$opts")" "$mp" 2>/dev/null && continue
  # gone since the list was read (another namespace unmounted it): nothing left to protect
  still_mounted "$raw" || continue
  echo "read-only $mp" >&2; exit 1
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
