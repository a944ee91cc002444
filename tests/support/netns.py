"""Hosts on one machine: Linux network namespaces joined by veth pairs, for tests and benches
that run Locust's master and workers as if each were a machine of its own (its own
addresses, its own loopback), with real TCP between them through the kernel.

Two networks, each a bridge with a veth pair to every member:

    control  10.231.1.0/24, bridge in the master's namespace: the master (.1) and every
             worker (.2, .3, ...): Locust's messages
    data     10.231.2.0/24, bridge in the target's namespace: the target (.1) and every
             worker (.2, .3, ...): the requests

The master is not on the data network: the target is reachable from the workers only, as a
server behind its load generators' network is. Namespace names are unique (``kvc<hex>``) and
everything is removed on the way out, a failure included (``Hosts`` is a context manager).
Needs root (CAP_NET_ADMIN) and iproute2: ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")
CONTROL = "10.231.1"
DATA = "10.231.2"
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces joined by veth pairs; None: it can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"kvcp{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
        _ip("-n", probe, "link", "add", "name", "br0", "type", "bridge")
    except subprocess.CalledProcessError as exc:
        return f"network namespaces with veth pairs are not allowed here: {exc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30, check=False)
    return None


class Hosts:
    """A master, ``workers`` workers and a target, each in a network namespace of its own."""

    def __init__(self, workers: int) -> None:
        self.prefix = f"kvc{secrets.token_hex(3)}"
        self.workers = [f"w{k + 1}" for k in range(workers)]
        self.names = ["master", *self.workers, "target"]
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host[0]}{host[1:] if host.startswith('w') else ''}"

    @property
    def master_addr(self) -> str:
        return f"{CONTROL}.1"

    @property
    def target_addr(self) -> str:
        return f"{DATA}.1"

    def addr(self, worker: str, network: str = CONTROL) -> str:
        return f"{network}.{self.workers.index(worker) + 2}"

    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _build(self) -> None:
        for host in self.names:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for hub, net, port, member in (
            ("master", CONTROL, "c", "ctl"),
            ("target", DATA, "d", "data"),
        ):
            hub_ns = self.ns(hub)
            _ip("-n", hub_ns, "link", "add", "name", "br0", "type", "bridge")
            _ip("-n", hub_ns, "addr", "add", f"{net}.1/24", "dev", "br0")
            _ip("-n", hub_ns, "link", "set", "br0", "up")
            for k, worker in enumerate(self.workers):
                ns, peer = self.ns(worker), f"{port}{k + 1}"
                _ip("-n", ns, "link", "add", "name", member, "type", "veth", "peer", "name", peer)
                _ip("-n", ns, "link", "set", peer, "netns", hub_ns)
                _ip("-n", ns, "addr", "add", f"{net}.{k + 2}/24", "dev", member)
                _ip("-n", ns, "link", "set", member, "up")
                _ip("-n", hub_ns, "link", "set", peer, "master", "br0")
                _ip("-n", hub_ns, "link", "set", peer, "up")

    def close(self) -> None:
        """Remove every namespace made (their veth pairs and bridges go with them)."""
        while self.made:
            ns = self.made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)

    def cmd(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def inside(self, host: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a thread of this process that has entered ``host``'s namespace (a
        namespace is a thread's: the rest of the process stays where it is); sockets it
        makes belong to that namespace for good."""
        return in_netns(self.ns(host), fn)


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """``fn()`` in a fresh thread that has entered network namespace ``ns`` (setns(2))."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns}")
            finally:
                os.close(fd)
            out.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            err.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if err:
        raise err[0]
    if not out:
        raise TimeoutError(f"nothing came back from namespace {ns} in 60 s")
    return out[0]
