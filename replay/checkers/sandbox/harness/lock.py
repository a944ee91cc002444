"""The runner's locks on itself and on every process below it: non-dumpable, and the seccomp
filter that denies new namespaces, ``ptrace`` and reading other processes' memory (the filter of
``sandbox.run``'s docstring). Part of the sandbox's harness script (see ``harness.runner``): the
standard library only."""

from __future__ import annotations

import os
from typing import Any


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
    """Install the seccomp filter of ``sandbox.run``'s docstring; "ok" or why not."""
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
