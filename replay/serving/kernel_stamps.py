"""A plain TCP connection whose every read says when its bytes reached this machine.

The socket is read with ``recvmsg`` and SO_TIMESTAMPNS, so each read carries the kernel's
receive time of its bytes; a read is stamped with that, not with when this process next ran.
On a loaded machine the two differ: the server's writes wake it, the scheduler may run the
server instead of us, and a read made 2-8 ms late (bench/README.md) would count that wait
as the server's, in every stream's gap at once. Linux only; elsewhere, and for https, the
pool uses the event loop's own transport and stamps a read when it runs.

TCP hands the kernel's stamp of the last segment a read took, and segments queued before a
read are merged into one buffer that keeps the last one's stamp (so reading less at a time
does not recover the earlier ones): when a stall lets several chunks arrive before one read,
they all carry the last one's time. The accumulator makes them one arrival (accumulator.py).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Protocol

AVAILABLE = sys.platform == "linux"
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value; Python 3.11 lacks it
READ_BYTES = 1 << 16
_TIMESPEC = struct.Struct("@qq")  # struct timespec on 64-bit Linux


class Receiver(Protocol):
    """What a stamped socket feeds: its bytes with their arrival (on the receiver's clock),
    then the end of the connection, as an asyncio protocol's ``connection_lost``."""

    now: Callable[[], float]

    def received(self, data: bytes, arrived: float) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...


async def connect(host: str, port: int) -> socket.socket:
    """A connected non-blocking socket with receive stamps on where the kernel has them
    (before the connect, so the first answer is stamped too), tried over the host's addresses
    in order."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            except OSError:  # a kernel without it (a sandbox's): reads are stamped as they run
                pass
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error


class StampedSocket:
    """The transport side of one connection (``write``, ``close``, ``abort``, ``is_closing``),
    its reads delivered to ``receiver`` with their kernel receive times."""

    def __init__(self, sock: socket.socket, receiver: Receiver) -> None:
        self.loop = asyncio.get_running_loop()
        self.sock, self.receiver = sock, receiver
        self.fd = sock.fileno()
        self.pending = b""  # written but not yet taken by the socket
        self.closed = False
        self.closing = False  # close() once what is pending is written
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(READ_BYTES, 64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        if not data:
            self._lost(None)
            return
        # Both clocks are read back to back, before anything else: the time between the two
        # readings (tens of microseconds if the process is preempted there) and a clock step
        # are the only error in moving the kernel's stamp onto the receiver's clock.
        arrived = self.receiver.now()
        wall = time.time()
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = _TIMESPEC.unpack_from(raw)
                # How long the bytes waited, on the wall clock the kernel stamps with, taken
                # off the receiver's own clock (which may be any).
                arrived -= max(0.0, wall - (sec + nsec * 1e-9))
        self.receiver.received(data, arrived)

    def write(self, data: bytes) -> None:
        if self.closed or self.closing:
            return
        if not self.pending:
            try:
                n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._lost(exc)
                return
            if n == len(data):
                return
            data = data[n:]
            self.loop.add_writer(self.fd, self._writable)
        self.pending += data

    def _writable(self) -> None:
        try:
            n = self.sock.send(self.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        self.pending = self.pending[n:]
        if not self.pending:
            self.loop.remove_writer(self.fd)
            if self.closing:
                self._lost(None)

    def is_closing(self) -> bool:
        return self.closed or self.closing

    def close(self) -> None:
        if self.pending:
            self.closing = True
        else:
            self._lost(None)

    def abort(self) -> None:
        self._lost(None)

    def _lost(self, exc: Exception | None) -> None:
        """Closed, by either side: the receiver hears of it on the next loop iteration, as
        from a transport."""
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self.pending:
            self.loop.remove_writer(self.fd)
        self.sock.close()
        self.loop.call_soon(self.receiver.connection_lost, exc)
